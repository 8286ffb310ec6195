// Small math shared by Tandem's CPU kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tandem {

// exp(x) for x <= 0, in plain float arithmetic that the compiler vectorises: std::exp is a
// scalar libm call, and a long context's softmax (or a wide MLP's SiLU) is mostly exps.
// Cephes' expf: range reduction by ln 2, a degree-6 polynomial; ~1 ulp.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);  // below this exp underflows; keeps the exponent field valid
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// x * sigmoid(x), through exp of a non-positive argument only (no overflow either way).
inline float silu(float x) {
  const float e = exp_nonpositive(-std::fabs(x));  // exp(-|x|), in (0, 1]
  return x >= 0.f ? x / (1.f + e) : x * e / (1.f + e);
}

}  // namespace tandem
