// Stands in for xtensor 0.26+, whose headers live in subfolders, on a machine that has the flat
// 0.24 layout: forwards to the flat header and records that the foldered path was taken.
#pragma once
#define GRADACCUM_TEST_FOLDERED_XARRAY_INCLUDED 1
#include <xtensor/xarray.hpp>
