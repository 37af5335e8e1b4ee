// Character-level training data for the demo: words read from a text file,
// turned into (previous-k characters -> next character) tokens, and grouped
// into accumulation windows of unequal microbatches.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace demo {

// Token 0 ('.') pads the context before a word and marks its end; 1..26 are
// 'a'..'z'. Every word of length L yields L + 1 tokens.
inline constexpr int boundary_token = 0;
inline constexpr int vocab_size = 27;

// The words of an English text or word list: maximal runs of ASCII letters,
// lowercased. Runs touching any other non-space byte (possessives, accented
// letters, digits) are skipped whole, so "Aachen's" or "café" add nothing
// rather than a fragment.
inline std::vector<std::string> read_words(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw std::runtime_error("cannot read data file '" + path.string() + "'");
  }
  constexpr std::string_view separators = ".,;:!?\"()-";  // punctuation between words
  std::vector<std::string> words;
  std::string chunk;
  while (in >> chunk) {
    std::string word;
    bool clean = true;
    const auto flush = [&] {
      if (clean && !word.empty()) {
        words.push_back(word);
      }
      word.clear();
      clean = true;
    };
    for (const char c : chunk) {
      if (c >= 'a' && c <= 'z') {
        word += c;
      } else if (c >= 'A' && c <= 'Z') {
        word += static_cast<char>(c - 'A' + 'a');
      } else if (separators.find(c) != std::string_view::npos) {
        flush();
      } else {
        clean = false;
      }
    }
    flush();
  }
  if (in.bad()) {
    throw std::runtime_error("error while reading data file '" + path.string() + "'");
  }
  return words;
}

// The tokens of some whole words, ready for the model: for token t,
// contexts[t * context + j] is the j-th previous character (oldest first)
// and targets[t] the character to predict.
struct token_batch {
  int context = 0;
  std::size_t sequences = 0;
  std::vector<int> contexts;
  std::vector<int> targets;

  std::size_t tokens() const { return targets.size(); }

  void append(const std::string& word) {
    std::vector<int> history(static_cast<std::size_t>(context), boundary_token);
    for (std::size_t i = 0; i <= word.size(); ++i) {
      const int next = i < word.size() ? word[i] - 'a' + 1 : boundary_token;
      contexts.insert(contexts.end(), history.begin(), history.end());
      targets.push_back(next);
      std::shift_left(history.begin(), history.end(), 1);
      history.back() = next;
    }
    ++sequences;
  }
};

inline token_batch make_batch(std::span<const std::string> words, int context) {
  token_batch batch;
  batch.context = context;
  for (const std::string& word : words) {
    batch.append(word);
  }
  return batch;
}

// One optimizer step's worth of data: microbatches of the plan's sizes (in
// sequences), so they hold different numbers of tokens.
struct window {
  std::vector<token_batch> microbatches;

  std::size_t tokens() const {
    std::size_t n = 0;
    for (const token_batch& mb : microbatches) {
      n += mb.tokens();
    }
    return n;
  }

  std::size_t sequences() const {
    std::size_t n = 0;
    for (const token_batch& mb : microbatches) {
      n += mb.sequences;
    }
    return n;
  }

  // The whole window as one batch: what a full-batch step computes on.
  token_batch merged() const {
    token_batch all;
    all.context = microbatches.front().context;
    for (const token_batch& mb : microbatches) {
      all.sequences += mb.sequences;
      all.contexts.insert(all.contexts.end(), mb.contexts.begin(), mb.contexts.end());
      all.targets.insert(all.targets.end(), mb.targets.begin(), mb.targets.end());
    }
    return all;
  }
};

inline std::size_t plan_sequences(std::span<const std::size_t> plan) {
  return std::accumulate(plan.begin(), plan.end(), std::size_t{0});
}

// Splits `words` into microbatches of the plan's sizes. The last window of
// an epoch gets fewer words, so its final microbatches shrink or vanish.
inline std::vector<token_batch> split_window(std::span<const std::string> words, std::span<const std::size_t> plan,
                                             int context) {
  std::vector<token_batch> microbatches;
  std::size_t begin = 0;
  for (const std::size_t size : plan) {
    const std::size_t count = std::min(size, words.size() - begin);
    if (count == 0) {
      break;
    }
    microbatches.push_back(make_batch(words.subspan(begin, count), context));
    begin += count;
  }
  return microbatches;
}

// Endless sequence of windows over the training words, reshuffled (from the
// seed) at every epoch start, so runs are reproducible.
class window_stream {
 public:
  window_stream(std::vector<std::string> words, std::vector<std::size_t> plan, int context, std::uint64_t seed)
      : words_(std::move(words)), plan_(std::move(plan)), context_(context), rng_(seed) {
    shuffle();
  }

  std::size_t windows_per_epoch() const {
    const std::size_t per_window = plan_sequences(plan_);
    return (words_.size() + per_window - 1) / per_window;
  }

  // The window at `index` of the current epoch, without advancing.
  window at(std::size_t index) const {
    const std::size_t per_window = plan_sequences(plan_);
    const std::span<const std::string> all(words_);
    const std::size_t begin = index * per_window;
    const auto words = all.subspan(begin, std::min(per_window, all.size() - begin));
    return {split_window(words, plan_, context_)};
  }

  window next() {
    if (next_index_ == windows_per_epoch()) {
      next_index_ = 0;
      shuffle();
    }
    return at(next_index_++);
  }

 private:
  void shuffle() { std::shuffle(words_.begin(), words_.end(), rng_); }

  std::vector<std::string> words_;
  std::vector<std::size_t> plan_;
  int context_;
  std::mt19937_64 rng_;
  std::size_t next_index_ = 0;
};

}  // namespace demo
