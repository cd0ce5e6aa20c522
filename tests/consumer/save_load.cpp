// Saves and loads a RotaryEmbedding with <rotary/rotary.h> as the only
// include: the umbrella header must be enough for torch::save / torch::load.
#include <rotary/rotary.h>

#include <cstdio>
#include <string>

bool save_load_round_trip(const std::string& path) {
  rotary::RotaryEmbedding saved(rotary::RotaryEmbeddingOptions(16).max_seq_len(32).theta(500.0));
  torch::save(saved, path);
  rotary::RotaryEmbedding loaded(rotary::RotaryEmbeddingOptions(16).max_seq_len(32).theta(500.0));
  torch::load(loaded, path);
  const bool same = torch::equal(saved->freqs, loaded->freqs) && torch::equal(saved->inv_freq, loaded->inv_freq);
  // A module built with other options refuses the file.
  rotary::RotaryEmbedding other(rotary::RotaryEmbeddingOptions(16).max_seq_len(32));
  bool refused = false;
  try {
    torch::load(other, path);
  } catch (const c10::ValueError&) {
    refused = true;
  }
  std::printf("consumer: save/load %s, other theta %s\n", same ? "ok" : "differs", refused ? "refused" : "accepted");
  return same && refused;
}
