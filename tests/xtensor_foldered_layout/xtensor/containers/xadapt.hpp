// Stands in for xtensor 0.26+'s <xtensor/containers/xadapt.hpp> (see xarray.hpp beside it).
#pragma once
#include <xtensor/xadapt.hpp>
