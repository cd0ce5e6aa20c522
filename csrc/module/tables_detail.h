// What tables.cpp (the state machine) and saved_tables.cpp (the check of
// saved buffers) both read from a module's options.
#pragma once

#include <rotary/freqs.h>
#include <rotary/options.h>

#include <cstdint>
#include <string>

namespace rotary {
namespace detail {

// The options with the rule's defaults filled in: an unset
// max_position_embeddings of "dynamic" is max_seq_len.
RotaryEmbeddingOptions with_defaults(RotaryEmbeddingOptions o);
std::string describe_options(const RotaryEmbeddingOptions& o);
// The frequencies of the options: the axial ones when axes_dim is set, else
// those of the rule.
RopeFrequencies frequencies_of(const RotaryEmbeddingOptions& o, const RopeScaling& s, int64_t seq_len);
void check_options(const RotaryEmbeddingOptions& options);
// Rows a module with these options holds in the state reached with seq_len.
int64_t rows_for(const RotaryEmbeddingOptions& o, int64_t seq_len);
// How far a held or saved table's entry may be from what the options build:
// 2^-22 times the attention scaling (at least 1).
double table_tolerance(double attention_scaling);

}  // namespace detail
}  // namespace rotary
