// Rotary position embedding, forward and backward, non-interleaved
// ("rotate_half") convention of Megatron-Core's apply_rotary_pos_emb and of HF
// LLaMA.  For one head vector t[0:d] at position s with angles f[0:rot]
// (f = cat(freqs, freqs) in both code bases), half = rot / 2, j < half:
//
//   forward:  out[j]        = t[j] * cos(f[j])               - t[j + half] * sin(f[j])
//             out[j + half] = t[j + half] * cos(f[j + half]) + t[j] * sin(f[j + half])
//             out[rot:d]    = t[rot:d]                       (partial rotary)
//   backward: the transpose,
//             dt[j]         = g[j] * cos(f[j]) + g[j + half] * sin(f[j + half])
//             dt[j + half]  = g[j + half] * cos(f[j + half]) - g[j] * sin(f[j])
//
// t and out are [s, b, h, d] views with arbitrary strides (last dim
// contiguous), so the HF layout [b, h, s, d] runs through the same kernel as a
// permuted view.  freqs is fp32 [s, bf, rot] with bf = 1 (shared by the batch)
// or b (per-sample positions).  Arithmetic is fp32; cos/sin are computed in
// fp32 from the fp32 angles.
//
// Launch geometry: one block per (position s, batch b); its threads first
// compute cos/sin of the rot angles of position s into shared memory (once,
// shared by all heads), then stride over (head, pack) work items: the rotated
// packs of a head come first (lane k reads t[k*VEC] and t[half + k*VEC], two
// coalesced runs), then the pass-through packs.  One read and one write of t.
#include "common.cuh"
#include "ops.h"

namespace p3d {
namespace {

struct RopeShape {
  int64_t s, b, h, d, rot;
  int64_t f_ss, f_sb;              // element strides of freqs over [s, b] (f_sb = 0: shared)
  int64_t in_ss, in_sb, in_sh;     // element strides of t in [s, b, h] order
  int64_t out_ss, out_sb, out_sh;  // and of out
};

template <typename T, int VEC>
__global__ void rope_kernel(const T* __restrict__ t, const float* __restrict__ freqs,
                            T* __restrict__ out, RopeShape sh, bool backward) {
  extern __shared__ float cs[];  // cos[0:rot], then sin[0:rot]
  float* sn = cs + sh.rot;
  const int64_t si = blockIdx.x, bi = blockIdx.y;
  for (int64_t k = threadIdx.x; k < sh.rot; k += blockDim.x) {
    float sv, cv;
    sincosf(freqs[si * sh.f_ss + bi * sh.f_sb + k], &sv, &cv);
    cs[k] = cv;
    sn[k] = sv;
  }
  __syncthreads();
  const int64_t half = sh.rot / 2;
  const int64_t nrot = half / VEC, npass = (sh.d - sh.rot) / VEC, per_head = nrot + npass;
  const T* tb = t + si * sh.in_ss + bi * sh.in_sb;
  T* ob = out + si * sh.out_ss + bi * sh.out_sb;
  const float sgn = backward ? -1.f : 1.f;
  for (int64_t it = threadIdx.x; it < sh.h * per_head; it += blockDim.x) {
    const int64_t head = it / per_head, k = it - head * per_head;
    const T* th = tb + head * sh.in_sh;
    T* oh = ob + head * sh.out_sh;
    if (k < nrot) {
      const int64_t j = k * VEC;
      const Pack<T, VEC> p1 = load_pack<T, VEC>(th + j);
      const Pack<T, VEC> p2 = load_pack<T, VEC>(th + half + j);
      Pack<T, VEC> o1, o2;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float x1 = static_cast<float>(p1.v[v]), x2 = static_cast<float>(p2.v[v]);
        const float c1 = cs[j + v], c2 = cs[half + j + v];
        // Forward uses sin(f[j]) for the first half and sin(f[j+half]) for the
        // second; the transpose swaps which sine goes where and flips signs.
        const float s1 = backward ? sn[half + j + v] : sn[j + v];
        const float s2 = backward ? sn[j + v] : sn[half + j + v];
        o1.v[v] = static_cast<T>(x1 * c1 - sgn * x2 * s1);
        o2.v[v] = static_cast<T>(x2 * c2 + sgn * x1 * s2);
      }
      store_pack<T, VEC>(oh + j, o1);
      store_pack<T, VEC>(oh + half + j, o2);
    } else {
      const int64_t j = sh.rot + (k - nrot) * VEC;
      store_pack<T, VEC>(oh + j, load_pack<T, VEC>(th + j));
    }
  }
}

}  // namespace

void rope_apply(const at::Tensor& t, const at::Tensor& freqs, at::Tensor& out, bool backward) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 4 && t.stride(3) == 1,
              "rope: t must be a 4-D [s, b, h, d] CUDA view with a contiguous last dim, got sizes ",
              t.sizes(), " strides ", t.strides());
  TORCH_CHECK(out.sizes() == t.sizes() && out.stride(3) == 1 && out.scalar_type() == t.scalar_type() &&
                  out.device() == t.device(),
              "rope: out must match t's sizes, dtype and device with a contiguous last dim");
  const int64_t s = t.size(0), d = t.size(3);
  TORCH_CHECK(freqs.scalar_type() == at::kFloat && freqs.is_contiguous() && freqs.dim() == 3 &&
                  freqs.size(0) == s && (freqs.size(1) == 1 || freqs.size(1) == t.size(1)) &&
                  freqs.device() == t.device(),
              "rope: freqs must be a contiguous float32 [s, 1 or b, rot_dim] tensor with s = ", s,
              ", b = ", t.size(1), ", got ", freqs.sizes(), " ", freqs.scalar_type());
  const int64_t rot = freqs.size(2);
  TORCH_CHECK(rot >= 2 && rot % 2 == 0 && rot <= d, "rope: rot_dim must be even and in [2, d = ", d,
              "], got ", rot);
  TORCH_CHECK(t.size(1) <= 65535, "rope: batch size must be at most 65535, got ", t.size(1));
  c10::cuda::CUDAGuard guard(t.device());
  if (t.numel() == 0) return;
  RopeShape sh{s, t.size(1), t.size(2), d, rot,
               freqs.stride(0), freqs.size(1) == 1 ? 0 : freqs.stride(1),
               t.stride(0), t.stride(1), t.stride(2),
               out.stride(0), out.stride(1), out.stride(2)};
  auto stream = c10::cuda::getCurrentCUDAStream();
  P3D_DISPATCH_FLOATING(t.scalar_type(), "rope", [&] {
    using T = scalar_t;
    constexpr int V = vec16<T>();
    bool vec = (rot / 2) % V == 0 && (d - rot) % V == 0 && aligned16(t.data_ptr()) &&
               aligned16(out.data_ptr());
    for (int i = 0; i < 3; ++i) vec = vec && t.stride(i) % V == 0 && out.stride(i) % V == 0;
    auto launch = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const int64_t work = sh.h * ((rot / 2) / VEC + (d - rot) / VEC);
      const int threads = work >= 256 ? 256 : round_up(work, 32);
      const dim3 grid(static_cast<unsigned>(s), static_cast<unsigned>(sh.b));
      rope_kernel<T, VEC><<<grid, threads, 2 * rot * sizeof(float), stream>>>(
          t.data_ptr<T>(), freqs.data_ptr<float>(), out.data_ptr<T>(), sh, backward);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (vec)
      launch(std::integral_constant<int, V>{});
    else
      launch(std::integral_constant<int, 1>{});
  });
}

}  // namespace p3d
