// AVX-512F + VBMI decode-and-multiply (kernels in inner_product_avx512_impl.h: the states are cut
// with vpermb + vpmultishiftqb). This file alone is compiled with -mavx512vbmi; nothing here runs
// unless Avx512VbmiSupported() said yes.
#include "kernels/cpu/inner_product.h"

#if defined(__x86_64__)
#include "kernels/cpu/inner_product_avx512_impl.h"

namespace exl3::cpu {

void InnerProductAvx512Vbmi(const Exl3LinearView& w, const float* xp, int num_tokens, int j0,
                            int j1, float* y) {
  InnerProductAvx512Impl<true>(w, xp, num_tokens, j0, j1, y);
}

}  // namespace exl3::cpu

#else  // not x86-64

namespace exl3::cpu {
void InnerProductAvx512Vbmi(const Exl3LinearView&, const float*, int, int, int, float*) {}
}  // namespace exl3::cpu

#endif
