#pragma once
/// @file
/// @brief `GRADACCUM_ALWAYS_INLINE`: for small checks on the per-call path that a compiler may
/// leave out of line in a large translation unit (GCC did for the accumulator's buffer check,
/// a call on every accumulate).

#if defined(__GNUC__) || defined(__clang__)
#define GRADACCUM_ALWAYS_INLINE [[gnu::always_inline]] inline
#else
#define GRADACCUM_ALWAYS_INLINE inline
#endif
