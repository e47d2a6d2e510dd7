// SplitMix64: a tiny pseudo-random generator whose output is identical on every platform and
// compiler (unlike std:: distributions), which keeps sampling and the built-in corpus
// reproducible byte for byte.
#pragma once
#include <cstdint>

namespace shardtrain {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n) for n >= 1 (modulo bias is below 2^-40 for the small n used here).
  uint64_t below(uint64_t n) { return next() % n; }
  // Uniform in [0, 1).
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  bool chance(double p) { return uniform() < p; }

 private:
  uint64_t state_;
};

// Mixes two values into one seed (e.g. a user seed and an epoch number).
inline uint64_t mix_seed(uint64_t a, uint64_t b) {
  SplitMix64 g(a ^ (b * 0xD1B54A32D192ED03ull + 0x8CB92BA72F3D8DD7ull));
  return g.next();
}

}  // namespace shardtrain
