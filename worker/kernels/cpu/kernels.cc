#include "worker/kernels/cpu/kernels.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace meshtrain::kernels::cpu {
namespace {

// Row-major C (M,N) = alpha * op(A) @ op(B) + beta * C.
void Gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
          float beta, float* C, int ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, A,
              lda, B, ldb, beta, C, ldc);
}
void Gemm(bool trans_a, bool trans_b, int M, int N, int K, double alpha, const double* A, int lda, const double* B,
          int ldb, double beta, double* C, int ldc) {
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, A,
              lda, B, ldb, beta, C, ldc);
}

}  // namespace

template <class T>
void EncoderForward(T* out, const int32_t* inp, const T* wte, const T* wpe, int B, int Tn, int C, int v_begin,
                    int v_end) {
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < Tn; ++t) {
      T* out_bt = out + (int64_t(b) * Tn + t) * C;
      const int token = inp[b * Tn + t];
      const T* wte_ix = token >= v_begin && token < v_end ? wte + int64_t(token - v_begin) * C : nullptr;
      const T* wpe_t = wpe ? wpe + int64_t(t) * C : nullptr;
      for (int i = 0; i < C; ++i) {
        out_bt[i] = wte_ix && wpe_t ? wte_ix[i] + wpe_t[i] : wte_ix ? wte_ix[i] : wpe_t ? wpe_t[i] : T(0);
      }
    }
  }
}

template <class T>
void EncoderBackward(T* dwte, T* dwpe, const T* dout, const int32_t* inp, int B, int Tn, int C, int v_begin,
                     int v_end) {
  // Serial: different positions can share a token row of dwte.
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < Tn; ++t) {
      const T* dout_bt = dout + (int64_t(b) * Tn + t) * C;
      const int token = inp[b * Tn + t];
      T* dwpe_t = dwpe + int64_t(t) * C;
      if (token >= v_begin && token < v_end) {
        T* dwte_ix = dwte + int64_t(token - v_begin) * C;
        for (int i = 0; i < C; ++i) dwte_ix[i] += dout_bt[i];
      }
      for (int i = 0; i < C; ++i) dwpe_t[i] += dout_bt[i];
    }
  }
}

template <class T>
void LayerNormForward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias, int B, int Tn, int C) {
  const T eps = T(1e-5);
#pragma omp parallel for
  for (int bt = 0; bt < B * Tn; ++bt) {
    const T* x = inp + int64_t(bt) * C;
    T m = 0;
    for (int i = 0; i < C; ++i) m += x[i];
    m /= C;
    T var = 0;
    for (int i = 0; i < C; ++i) var += (x[i] - m) * (x[i] - m);
    var /= C;
    const T s = T(1) / std::sqrt(var + eps);
    T* o = out + int64_t(bt) * C;
    for (int i = 0; i < C; ++i) o[i] = (s * (x[i] - m)) * weight[i] + bias[i];
    mean[bt] = m;
    rstd[bt] = s;
  }
}

template <class T>
void LayerNormBackward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, const T* mean,
                       const T* rstd, int B, int Tn, int C) {
  // Serial over positions: every position adds into dweight and dbias.
  for (int bt = 0; bt < B * Tn; ++bt) {
    const T* dout_bt = dout + int64_t(bt) * C;
    const T* x = inp + int64_t(bt) * C;
    T* dx = dinp + int64_t(bt) * C;
    const T m = mean[bt], s = rstd[bt];
    T dnorm_mean = 0, dnorm_norm_mean = 0;
    for (int i = 0; i < C; ++i) {
      const T norm = (x[i] - m) * s;
      const T dnorm = weight[i] * dout_bt[i];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean /= C;
    dnorm_norm_mean /= C;
    for (int i = 0; i < C; ++i) {
      const T norm = (x[i] - m) * s;
      const T dnorm = weight[i] * dout_bt[i];
      dbias[i] += dout_bt[i];
      dweight[i] += norm * dout_bt[i];
      dx[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  }
}

template <class T>
void MatmulForward(T* out, const T* inp, const T* weight, const T* bias, int B, int Tn, int C, int OC) {
  const int BT = B * Tn;
  Gemm(false, true, BT, OC, C, T(1), inp, C, weight, C, T(0), out, OC);
  if (bias == nullptr) return;
#pragma omp parallel for
  for (int bt = 0; bt < BT; ++bt) {
    T* o = out + int64_t(bt) * OC;
    for (int j = 0; j < OC; ++j) o[j] += bias[j];
  }
}

template <class T>
void MatmulBackward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, int B, int Tn, int C,
                    int OC) {
  const int BT = B * Tn;
  Gemm(false, false, BT, C, OC, T(1), dout, OC, weight, C, T(1), dinp, C);    // dinp += dout @ weight
  Gemm(true, false, OC, C, BT, T(1), dout, OC, inp, C, T(1), dweight, C);     // dweight += dout^T @ inp
  if (dbias == nullptr) return;
#pragma omp parallel for
  for (int j = 0; j < OC; ++j) {
    T sum = 0;
    for (int bt = 0; bt < BT; ++bt) sum += dout[int64_t(bt) * OC + j];
    dbias[j] += sum;
  }
}

template <class T>
void AttentionForward(T* out, T* preatt, T* att, const T* inp, int B, int Tn, int C, int NH) {
  const int C3 = 3 * C, hs = C / NH;
  const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel for collapse(3)
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < Tn; ++t) {
      for (int h = 0; h < NH; ++h) {
        const T* query = inp + (int64_t(b) * Tn + t) * C3 + h * hs;
        T* preatt_bth = preatt + ((int64_t(b) * NH + h) * Tn + t) * Tn;
        T* att_bth = att + ((int64_t(b) * NH + h) * Tn + t) * Tn;
        T maxval = std::numeric_limits<T>::lowest();
        for (int t2 = 0; t2 <= t; ++t2) {
          const T* key = inp + (int64_t(b) * Tn + t2) * C3 + h * hs + C;
          T dot = 0;
          for (int i = 0; i < hs; ++i) dot += query[i] * key[i];
          dot *= scale;
          preatt_bth[t2] = dot;
          maxval = std::max(maxval, dot);
        }
        T expsum = 0;
        for (int t2 = 0; t2 <= t; ++t2) {
          const T e = std::exp(preatt_bth[t2] - maxval);
          att_bth[t2] = e;
          expsum += e;
        }
        const T inv = T(1) / expsum;
        for (int t2 = 0; t2 < Tn; ++t2) {
          if (t2 <= t) {
            att_bth[t2] *= inv;
          } else {  // masked: kept at zero so the saved tensors are fully defined
            att_bth[t2] = 0;
            preatt_bth[t2] = 0;
          }
        }
        T* out_bth = out + (int64_t(b) * Tn + t) * C + h * hs;
        std::fill(out_bth, out_bth + hs, T(0));
        for (int t2 = 0; t2 <= t; ++t2) {
          const T* value = inp + (int64_t(b) * Tn + t2) * C3 + h * hs + 2 * C;
          const T a = att_bth[t2];
          for (int i = 0; i < hs; ++i) out_bth[i] += a * value[i];
        }
      }
    }
  }
}

template <class T>
void AttentionBackward(T* dinp, T* dpreatt, T* datt, const T* dout, const T* inp, const T* att, int B, int Tn, int C,
                       int NH) {
  const int C3 = 3 * C, hs = C / NH;
  const T scale = T(1) / std::sqrt(T(hs));
  // Parallel over (batch, head): each writes only its own head's slice of dinp.
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      for (int t = 0; t < Tn; ++t) {
        const T* att_bth = att + ((int64_t(b) * NH + h) * Tn + t) * Tn;
        T* datt_bth = datt + ((int64_t(b) * NH + h) * Tn + t) * Tn;
        T* dpreatt_bth = dpreatt + ((int64_t(b) * NH + h) * Tn + t) * Tn;
        const T* dout_bth = dout + (int64_t(b) * Tn + t) * C + h * hs;
        const T* query = inp + (int64_t(b) * Tn + t) * C3 + h * hs;
        T* dquery = dinp + (int64_t(b) * Tn + t) * C3 + h * hs;
        // out = att @ value
        for (int t2 = 0; t2 <= t; ++t2) {
          const T* value = inp + (int64_t(b) * Tn + t2) * C3 + h * hs + 2 * C;
          T* dvalue = dinp + (int64_t(b) * Tn + t2) * C3 + h * hs + 2 * C;
          T d = 0;
          for (int i = 0; i < hs; ++i) {
            d += value[i] * dout_bth[i];
            dvalue[i] += att_bth[t2] * dout_bth[i];
          }
          datt_bth[t2] += d;
        }
        // softmax: dpreatt = att * (datt - sum(att * datt))
        T dot = 0;
        for (int t2 = 0; t2 <= t; ++t2) dot += att_bth[t2] * datt_bth[t2];
        for (int t2 = 0; t2 <= t; ++t2) dpreatt_bth[t2] += att_bth[t2] * (datt_bth[t2] - dot);
        // preatt = scale * query . key
        for (int t2 = 0; t2 <= t; ++t2) {
          const T* key = inp + (int64_t(b) * Tn + t2) * C3 + h * hs + C;
          T* dkey = dinp + (int64_t(b) * Tn + t2) * C3 + h * hs + C;
          const T g = dpreatt_bth[t2] * scale;
          for (int i = 0; i < hs; ++i) {
            dquery[i] += key[i] * g;
            dkey[i] += query[i] * g;
          }
        }
      }
    }
  }
}

namespace {
template <class T>
constexpr T kGeluScale = T(0.7978845608028654);  // sqrt(2/pi)
}  // namespace

template <class T>
void GeluForward(T* out, const T* inp, int64_t N) {
#pragma omp parallel for
  for (int64_t i = 0; i < N; ++i) {
    const T x = inp[i];
    out[i] = T(0.5) * x * (T(1) + std::tanh(kGeluScale<T> * (x + T(0.044715) * x * x * x)));
  }
}

template <class T>
void GeluBackward(T* dinp, const T* inp, const T* dout, int64_t N) {
#pragma omp parallel for
  for (int64_t i = 0; i < N; ++i) {
    const T x = inp[i];
    const T tanh_out = std::tanh(kGeluScale<T> * (x + T(0.044715) * x * x * x));
    const T sech2 = T(1) - tanh_out * tanh_out;
    const T local = T(0.5) * (T(1) + tanh_out) +
                    x * T(0.5) * sech2 * kGeluScale<T> * (T(1) + T(3) * T(0.044715) * x * x);
    dinp[i] += local * dout[i];
  }
}

template <class T>
void ResidualForward(T* out, const T* inp1, const T* inp2, int64_t N) {
#pragma omp parallel for
  for (int64_t i = 0; i < N; ++i) out[i] = inp1[i] + inp2[i];
}

template <class T>
void ResidualBackward(T* dinp1, T* dinp2, const T* dout, int64_t N) {
#pragma omp parallel for
  for (int64_t i = 0; i < N; ++i) {
    dinp1[i] += dout[i];
    dinp2[i] += dout[i];
  }
}

template <class T>
void SoftmaxCrossEntropyForward(T* probs, T* losses, const T* logits, const int32_t* targets, int B, int Tn, int V) {
#pragma omp parallel for
  for (int bt = 0; bt < B * Tn; ++bt) {
    const T* l = logits + int64_t(bt) * V;
    T* p = probs + int64_t(bt) * V;
    const T maxval = *std::max_element(l, l + V);
    T sum = 0;
    for (int i = 0; i < V; ++i) {
      p[i] = std::exp(l[i] - maxval);
      sum += p[i];
    }
    for (int i = 0; i < V; ++i) p[i] /= sum;
    // -log p[target], from the logits so that tiny probabilities keep their precision
    losses[bt] = std::log(sum) - (l[targets[bt]] - maxval);
  }
}

uint64_t MixKey(uint64_t key, uint64_t counter) {
  uint64_t x = key ^ (counter + 0x9E3779B97F4A7C15ull + (key << 6) + (key >> 2));
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

bool DropoutKeeps(uint64_t key, uint64_t index, float p) {
  // 24 random bits: a uniform in [0, 1) that a float holds exactly.
  return float(MixKey(key, index) >> 40) * (1.0f / 16777216.0f) >= p;
}

template <class T>
void Dropout(T* x, int64_t rows, int width, float p, uint64_t key, int64_t first_row, int64_t row_stride,
             int64_t first_column) {
  if (p <= 0) return;
  const T scale = T(1) / (T(1) - T(p));
#pragma omp parallel for
  for (int64_t i = 0; i < rows; ++i) {
    T* row = x + i * width;
    const uint64_t base = uint64_t((first_row + i) * row_stride + first_column);
    for (int j = 0; j < width; ++j) row[j] = DropoutKeeps(key, base + uint64_t(j), p) ? row[j] * scale : T(0);
  }
}

template <class T>
void VocabSliceStats(T* stats, const T* logits, const int32_t* targets, int B, int Tn, int V, int v_begin) {
#pragma omp parallel for
  for (int bt = 0; bt < B * Tn; ++bt) {
    const T* l = logits + int64_t(bt) * V;
    const T maxval = *std::max_element(l, l + V);
    T sum = 0;
    for (int i = 0; i < V; ++i) sum += std::exp(l[i] - maxval);
    const int target = targets ? targets[bt] - v_begin : -1;
    stats[3 * bt] = maxval;
    stats[3 * bt + 1] = sum;
    stats[3 * bt + 2] = target >= 0 && target < V ? l[target] : T(0);
  }
}

template <class T>
void VocabSliceSoftmax(T* probs, T* losses, const T* logits, const T* all_stats, int slices, int B, int Tn, int V) {
  const int64_t BT = int64_t(B) * Tn;
#pragma omp parallel for
  for (int64_t bt = 0; bt < BT; ++bt) {
    T maxval = all_stats[3 * bt];
    for (int s = 1; s < slices; ++s) maxval = std::max(maxval, all_stats[3 * (s * BT + bt)]);
    T sum = 0, target_logit = 0;
    for (int s = 0; s < slices; ++s) {
      const T* st = all_stats + 3 * (s * BT + bt);
      sum += st[1] * std::exp(st[0] - maxval);
      target_logit += st[2];
    }
    const T* l = logits + bt * V;
    T* p = probs + bt * V;
    for (int i = 0; i < V; ++i) p[i] = std::exp(l[i] - maxval) / sum;
    if (losses) losses[bt] = std::log(sum) - (target_logit - maxval);
  }
}

template <class T>
void SoftmaxCrossEntropyBackward(T* dlogits, const T* probs, const int32_t* targets, T dloss, int B, int Tn, int V,
                                 int v_begin) {
#pragma omp parallel for
  for (int bt = 0; bt < B * Tn; ++bt) {
    T* d = dlogits + int64_t(bt) * V;
    const T* p = probs + int64_t(bt) * V;
    const int target = targets[bt] - v_begin;
    for (int i = 0; i < V; ++i) d[i] += (p[i] - (i == target ? T(1) : T(0))) * dloss;
  }
}

void AdamWUpdate(float* params, const float* grads, float* m, float* v, int64_t N, float lr, float beta1, float beta2,
                 float eps, float weight_decay, int64_t t) {
  const float correction1 = 1.0f - std::pow(beta1, float(t));
  const float correction2 = 1.0f - std::pow(beta2, float(t));
#pragma omp parallel for
  for (int64_t i = 0; i < N; ++i) {
    const float g = grads[i];
    m[i] = beta1 * m[i] + (1.0f - beta1) * g;
    v[i] = beta2 * v[i] + (1.0f - beta2) * g * g;
    const float m_hat = m[i] / correction1;
    const float v_hat = v[i] / correction2;
    params[i] -= lr * (m_hat / (std::sqrt(v_hat) + eps) + weight_decay * params[i]);
  }
}

#define MESHTRAIN_INSTANTIATE(T)                                                                                     \
  template void EncoderForward<T>(T*, const int32_t*, const T*, const T*, int, int, int, int, int);                 \
  template void EncoderBackward<T>(T*, T*, const T*, const int32_t*, int, int, int, int, int);                      \
  template void LayerNormForward<T>(T*, T*, T*, const T*, const T*, const T*, int, int, int);                       \
  template void LayerNormBackward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, int, int, int);   \
  template void MatmulForward<T>(T*, const T*, const T*, const T*, int, int, int, int);                             \
  template void MatmulBackward<T>(T*, T*, T*, const T*, const T*, const T*, int, int, int, int);                    \
  template void AttentionForward<T>(T*, T*, T*, const T*, int, int, int, int);                                     \
  template void AttentionBackward<T>(T*, T*, T*, const T*, const T*, const T*, int, int, int, int);                \
  template void GeluForward<T>(T*, const T*, int64_t);                                                              \
  template void GeluBackward<T>(T*, const T*, const T*, int64_t);                                                   \
  template void ResidualForward<T>(T*, const T*, const T*, int64_t);                                                \
  template void ResidualBackward<T>(T*, T*, const T*, int64_t);                                                     \
  template void SoftmaxCrossEntropyForward<T>(T*, T*, const T*, const int32_t*, int, int, int);                     \
  template void Dropout<T>(T*, int64_t, int, float, uint64_t, int64_t, int64_t, int64_t);                           \
  template void VocabSliceStats<T>(T*, const T*, const int32_t*, int, int, int, int);                              \
  template void VocabSliceSoftmax<T>(T*, T*, const T*, const T*, int, int, int, int);                               \
  template void SoftmaxCrossEntropyBackward<T>(T*, const T*, const int32_t*, T, int, int, int, int);

MESHTRAIN_INSTANTIATE(float)
MESHTRAIN_INSTANTIATE(double)
#undef MESHTRAIN_INSTANTIATE

}  // namespace meshtrain::kernels::cpu
