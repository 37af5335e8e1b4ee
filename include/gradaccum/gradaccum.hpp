#pragma once
/// @file
/// @brief Umbrella header: the whole core, no backend. Include a backend header next to it,
/// e.g. `<gradaccum/backends/eigen.hpp>`.

#include "gradaccum/backend.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/dynamic_loss_scale.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/extern_templates.hpp"
#include "gradaccum/global_norm.hpp"
#include "gradaccum/gradient_buffer.hpp"
#include "gradaccum/gradients_accumulator.hpp"
#include "gradaccum/gradients_params.hpp"
#include "gradaccum/kernels.hpp"
#include "gradaccum/parameter_set.hpp"
#include "gradaccum/records.hpp"
#include "gradaccum/shape.hpp"
#include "gradaccum/sharded_gradients.hpp"
#include "gradaccum/type_list.hpp"
#include "gradaccum/version.hpp"
#include "gradaccum/weighted_gradients_accumulator.hpp"
