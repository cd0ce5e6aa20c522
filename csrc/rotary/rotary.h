// Umbrella header: everything a C++ user of rotary needs.
#pragma once

#include <rotary/axes.h>
#include <rotary/freqs.h>
#include <rotary/front_end.h>
#include <rotary/func_options.h>
#include <rotary/kv_cache.h>
#include <rotary/module.h>
#include <rotary/ops.h>
#include <rotary/options.h>
#include <rotary/schemes.h>
#include <rotary/tables.h>

// torch::save / torch::load of a RotaryEmbedding need nothing more.
#include <torch/serialize.h>
