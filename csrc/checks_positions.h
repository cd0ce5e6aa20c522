// By-value checks of host-side positions (checks_axes.cpp), shared by
// prepare_rope's 1-D and N-D paths.
#pragma once

#include "rope_params.h"

namespace rotary {
namespace detail {

// Every token's position (offsets or ids, 1-D) lies in [0, 2^60) and, without
// inv_freq, inside the table; the message names the token and the argument.
void check_positions_in_table(const char* op, const kernel::RopeParams& p);

}  // namespace detail
}  // namespace rotary
