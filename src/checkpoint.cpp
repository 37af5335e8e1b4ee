// The checkpoint code compiled once (GRADACCUM_SEPARATE_COMPILATION): the `gradaccum-checkpoint`
// library, or this file added to a build whose every file defines the macro.
#ifndef GRADACCUM_SEPARATE_COMPILATION
#error \
    "src/checkpoint.cpp is compiled with GRADACCUM_SEPARATE_COMPILATION, as every file that includes <gradaccum/checkpoint.hpp> must be"
#endif

#include "gradaccum/checkpoint.hpp"
#include "gradaccum/checkpoint/files.hpp"
