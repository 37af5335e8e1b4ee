#pragma once
/// @file
/// @brief cereal serialization of records, through every cereal archive.
///
/// cereal already gives the archives (binary, portable binary, JSON, XML), name-value pairs,
/// class versions and a raw-bytes path (`cereal::binary_data`). This header adds free `save` /
/// `load` functions next to the record types, so a plain `archive(record)` works, and fixes the
/// format (field names are those of the text archives; binary archives write the same fields in
/// the same order, unnamed):
///
/// | type                          | fields, in order                                              |
/// |-------------------------------|---------------------------------------------------------------|
/// | `weighted_gradients_record`   | `record`, `state`, `gradients`                                |
/// | `weighted_accumulation_state` | `record`, `dtype` (text name), `loss_scale`, `total_weight`, `microbatches`,
/// `checksum` | | `gradients_params_record`     | `record`, `tensors` (in record order: sorted by id), `checksum` | |
/// `tensor_record`               | `id`, `dtype` (text name), `shape`, `values` (row-major)      | |
/// `dynamic_loss_scale_state`    | `record`, `scale`, `growth_tracker`, `hysteresis_left`, `checksum` |
///
/// - Every type carries `record_format_version` as its cereal class version; only that version
///   loads.
/// - `record` is the tag that names the record's type: in text archives its name
///   ("weighted_gradients_record", "gradients_params_record", "weighted_accumulation_state",
///   "dynamic_loss_scale_state"), in binary archives 8 bytes ("gradaccW", "gradaccG",
///   "gradaccS", "gradaccL"). A loader given another record type refuses it naming both, and a
///   binary checkpoint's first bytes (cereal's class version, then the tag; in a portable binary
///   archive after its byte-order byte) tell which archive wrote it.
/// - `checksum` is the XXH3-64 of the content before it, over a canonical byte stream that does
///   not depend on the archive: for a state its dtype name, the bits of `loss_scale` and
///   `total_weight` and `microbatches`; for gradients each tensor's id, dtype name, rank,
///   dimensions, value count and values (16-bit values as their bit patterns), integers and
///   values little-endian and text as its length and bytes. Binary archives hash a gradients
///   record as two blocks instead (see below). Loading recomputes it and refuses a mismatch
///   with `errc::invalid_record`, so a changed bit that still parses (a value, an id, a weight)
///   is caught.
/// - Ids are at most `max_id_length` bytes. Text archives cannot hold an id with a NUL byte
///   (cereal's JSON and XML archives cut strings there): saving one to them throws.
/// - Dtypes are written as their text names ("F32"); 16-bit values as their bit patterns.
/// - Binary archives write a gradients record as its tensor count, one directory block (per
///   tensor its id, dtype code, shape and where its values are), the directory's checksum and
///   then every value as one block (see "The values block of a binary gradients record"
///   below), whose checksum is the record's `checksum`: an accumulator's buffer is written as
///   it is and read back with one read. Strings and lists elsewhere are a size followed by one
///   raw block, never element by element.
/// - Text archives write a gradients record as a list of `tensor_record` nodes (one node per
///   tensor, which a text reader parses anyway). They write shapes as arrays of numbers and values as one
///   string of numbers separated by spaces, each the shortest text that reads back to the same
///   value (`std::to_chars`, about 10 bytes per F32): exact for every finite value, ±inf and
///   NaN; a NaN keeps its sign, and its payload survives binary archives only.
///
/// Loading treats the bytes as untrusted. Every problem found by these functions throws
/// `gradaccum::error` naming it: `errc::invalid_state` for the accumulation state's fields and
/// their agreement with the tensors, `errc::invalid_record` for everything else (format versions,
/// tensors, structure, truncation outside the state). The object being loaded is replaced only on
/// success, and loaded records are `validate`d (so a weighted record's tensors are in its state's
/// work dtype). Memory grows only as bytes arrive: counts are checked against shapes before
/// anything is allocated, and raw blocks are read in chunks that grow geometrically with what
/// has been read — or at once when the archive knows how many bytes remain and they suffice
/// (the archives of `<gradaccum/checkpoint.hpp>` do).
///
/// cereal's XML output archive formats every value through a stream that swallows
/// `std::bad_alloc`, and its JSON archive terminates when a save throws midway; the checkpoint
/// functions of `<gradaccum/checkpoint.hpp>` write JSON with the library's own archives instead
/// (`checkpoint/text_archives.hpp`). A plain `archive(record)` into cereal's text archives keeps
/// those faults; the checksum then refuses at load what a swallowed failure wrote wrong.
///
/// Some failures happen inside cereal before these functions run, so untrusted bytes are best
/// read with `parse_checkpoint` and `load_checkpoint`: they turn the `cereal::Exception` of an
/// input too short for the outermost record's version into `gradaccum::error`, and read JSON
/// with the library's parser, which bounds nesting depth (RapidJSON and rapidxml recurse once per
/// level) and keeps every byte of a string. cereal's XML input archive (1.3) also dereferences a
/// null node for a document without a record: give it only documents you wrote.

#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <istream>
#include <limits>
#include <new>
#include <optional>
#include <span>
#include <stdexcept>
#include <streambuf>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <variant>
#include <vector>

#include <cereal/cereal.hpp>

#include "gradaccum/checkpoint/record_fields.hpp"
#include "gradaccum/checkpoint/record_loading.hpp"
#include "gradaccum/checkpoint/record_saving.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/dynamic_loss_scale.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/records.hpp"
#include "gradaccum/shape.hpp"

namespace gradaccum {

// ---- The records' cereal functions (found by cereal through argument-dependent lookup) ------

template <class Archive>
void save(Archive& ar, const tensor_record& tensor, std::uint32_t version);
template <class Archive>
void load(Archive& ar, tensor_record& tensor, std::uint32_t version);

/// @throws error(errc::invalid_record) for a record that would not load back (see `validate`).
template <class Archive>
void save(Archive& ar, const gradients_params_record& record, std::uint32_t version);
template <class Archive>
void load(Archive& ar, gradients_params_record& record, std::uint32_t version);

/// @throws error(errc::invalid_state) for a state that would not load back (see `validate`).
template <class Archive>
void save(Archive& ar, const weighted_accumulation_state& state, std::uint32_t version);
template <class Archive>
void load(Archive& ar, weighted_accumulation_state& state, std::uint32_t version);

/// @throws error(errc::invalid_state) or error(errc::invalid_record) for a record that would not
/// load back (see `validate`).
template <class Archive>
void save(Archive& ar, const weighted_gradients_record& record, std::uint32_t version);
template <class Archive>
void load(Archive& ar, weighted_gradients_record& record, std::uint32_t version);

/// The loss scaler's state, exactly (a double's bits survive every archive), and its checksum.
/// @throws error(errc::invalid_state) for a scale that is not a positive F32 value or a zero
/// hysteresis_left; `state` is unchanged on error. The constructor of `dynamic_loss_scale`
/// checks the rest against its options.
template <class Archive>
void save(Archive& ar, const dynamic_loss_scale_state& state, std::uint32_t version);
template <class Archive>
void load(Archive& ar, dynamic_loss_scale_state& state, std::uint32_t version);

template <class Archive>
void save(Archive& ar, const tensor_record& tensor, const std::uint32_t /*version*/) {
  detail::save_tensor(ar, detail::view_of(tensor));
}

template <class Archive>
void load(Archive& ar, tensor_record& tensor, const std::uint32_t version) {
  detail::record_sink sink;
  detail::tensor_into<detail::record_sink> into{&sink};
  detail::load(ar, into, version);
  tensor = std::move(sink.record.gradients.tensors.front());
}

template <class Archive>
void save(Archive& ar, const gradients_params_record& record, const std::uint32_t /*version*/) {
  validate(record);
  detail::save_checksummed_tensors(ar, record.tensors);
}

template <class Archive>
void load(Archive& ar, gradients_params_record& record, const std::uint32_t version) {
  detail::record_sink sink;
  detail::gradients_into<detail::record_sink> into{&sink};
  detail::load(ar, into, version);
  validate(sink.record.gradients);
  record = std::move(sink.record.gradients);
}

template <class Archive>
void save(Archive& ar, const weighted_accumulation_state& state, const std::uint32_t /*version*/) {
  validate(state);
  detail::save_tag(ar, detail::state_tag);
  detail::save_string(ar, "dtype", to_string(state.dtype));
  ar(cereal::make_nvp("loss_scale", state.loss_scale), cereal::make_nvp("total_weight", state.total_weight),
     cereal::make_nvp("microbatches", state.microbatches), cereal::make_nvp("checksum", detail::state_checksum(state)));
}

template <class Archive>
void load(Archive& ar, weighted_accumulation_state& state, const std::uint32_t version) {
  detail::check_format_version(version, "an accumulation state");
  detail::check_tag(ar, detail::state_tag);
  const detail::load_site site{errc::invalid_state, "accumulation state"};
  weighted_accumulation_state loaded;
  loaded.dtype = detail::load_dtype(ar, site);
  loaded.loss_scale = detail::load_real(ar, site, "loss_scale");
  loaded.total_weight = detail::load_real(ar, site, "total_weight");
  loaded.microbatches = detail::load_unsigned(ar, site, "microbatches", std::numeric_limits<std::uint64_t>::max());
  // The checksum first: a corrupt state is reported as corrupt, not as an implausible value.
  detail::check_checksum(ar, {errc::invalid_record, "accumulation state"}, detail::state_checksum(loaded));
  validate(loaded);
  state = loaded;
}

template <class Archive>
void save(Archive& ar, const dynamic_loss_scale_state& state, const std::uint32_t /*version*/) {
  detail::save_tag(ar, detail::loss_scale_tag);
  ar(cereal::make_nvp("scale", state.scale), cereal::make_nvp("growth_tracker", state.growth_tracker),
     cereal::make_nvp("hysteresis_left", state.hysteresis_left),
     cereal::make_nvp("checksum", detail::loss_scale_checksum(state)));
}

template <class Archive>
void load(Archive& ar, dynamic_loss_scale_state& state, const std::uint32_t version) {
  detail::check_format_version(version, "a loss scale state");
  detail::check_tag(ar, detail::loss_scale_tag);
  const detail::load_site site{errc::invalid_state, "loss scale state"};
  dynamic_loss_scale_state loaded;
  loaded.scale = detail::load_real(ar, site, "scale");
  loaded.growth_tracker = detail::load_unsigned(ar, site, "growth_tracker", std::numeric_limits<std::uint64_t>::max());
  loaded.hysteresis_left =
      detail::load_unsigned(ar, site, "hysteresis_left", std::numeric_limits<std::uint64_t>::max());
  detail::check_checksum(ar, {errc::invalid_record, "loss scale state"}, detail::loss_scale_checksum(loaded));
  if (!detail::valid_f32_scale(loaded.scale)) site.fail({"has scale ", loaded.scale, ", not a positive F32 value."});
  if (loaded.hysteresis_left == 0) site.fail({"has hysteresis_left 0; at least 1 is needed."});
  state = loaded;
}

template <class Archive>
void save(Archive& ar, const weighted_gradients_record& record, const std::uint32_t /*version*/) {
  validate(record);
  detail::save_tag(ar, detail::window_tag);
  ar(cereal::make_nvp("state", record.state), cereal::make_nvp("gradients", record.gradients));
}

template <class Archive>
void load(Archive& ar, weighted_gradients_record& record, const std::uint32_t version) {
  detail::record_sink sink;
  detail::weighted_into<detail::record_sink> into{&sink};
  detail::load(ar, into, version);
  validate(sink.record);
  record = std::move(sink.record);
}

}  // namespace gradaccum

CEREAL_CLASS_VERSION(gradaccum::tensor_record, gradaccum::record_format_version)
CEREAL_CLASS_VERSION(gradaccum::gradients_params_record, gradaccum::record_format_version)
CEREAL_CLASS_VERSION(gradaccum::weighted_accumulation_state, gradaccum::record_format_version)
CEREAL_CLASS_VERSION(gradaccum::weighted_gradients_record, gradaccum::record_format_version)
CEREAL_CLASS_VERSION(gradaccum::dynamic_loss_scale_state, gradaccum::record_format_version)
CEREAL_CLASS_VERSION(gradaccum::detail::tensor_view, gradaccum::record_format_version)
CEREAL_CLASS_VERSION(gradaccum::detail::gradients_view, gradaccum::record_format_version)
CEREAL_CLASS_VERSION(gradaccum::detail::weighted_gradients_view, gradaccum::record_format_version)
