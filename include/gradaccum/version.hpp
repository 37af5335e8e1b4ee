#pragma once
/// @file
/// @brief Library version; kept equal to the `version:` of the root meson.build (a test checks it).

#define GRADACCUM_VERSION_MAJOR 0
#define GRADACCUM_VERSION_MINOR 1
#define GRADACCUM_VERSION_PATCH 0
#define GRADACCUM_VERSION_STRING "0.1.0"
/// Single comparable number: major * 10000 + minor * 100 + patch.
#define GRADACCUM_VERSION (GRADACCUM_VERSION_MAJOR * 10000 + GRADACCUM_VERSION_MINOR * 100 + GRADACCUM_VERSION_PATCH)
