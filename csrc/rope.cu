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
// permuted view; or [s, b, groups, h, d] views, so that grouped q heads are
// read from and their gradients written into linear_qkv's [s, b, ng, (np/ng + 2) d].  One launch takes one
// tensor or two (q and k, whose head counts may differ) rotated by the same angles, and optionally a last
// tensor copied unrotated (v's gradient, so that the three gradients land in linear_qkv's layout in one pass).  The angles come as fp32 cos
// and sin of shape [s, bf, rot], bf = 1 (shared by the batch) or b
// (per-sample positions); the Python wrapper computes them once per freqs
// tensor, so all the layers of a forward share them.  Arithmetic is fp32,
// rounded once to t's dtype.
//
// Launch geometry: a thread per (tensor, head, pack) work item of a (position
// s, sample b) slice: the rotated packs of a head (item k reads t[k*VEC] and
// t[half + k*VEC], two coalesced runs, and the matching cos/sin, which stay in
// L2), then its pass-through packs; grid (s, b, blocks per slice).  No
// barriers and no shared memory: one read and one write of t, both with an
// evict-first hint (load_stream) so that cos/sin keep their place in L2.
#include <algorithm>

#include "common.cuh"
#include "ops.h"

namespace p3d {
namespace {

constexpr int kMaxRopeTensors = 3;

// Element strides in [s, b, g, h] order of one input/output pair: head i is head i % hpg of group i / hpg
// (a 4-D tensor is one group: hpg = h, stride 0), so linear_qkv's output [s, b, ng, (np/ng + 2) * d] is
// read and written in place, its q heads as a 5-D view [s, b, ng, np/ng, d].
struct RopeTensor {
  int64_t h, hpg;
  int64_t copy;  // 1: copied, not rotated (all d features pass through)
  int64_t in_ss, in_sb, in_sg, in_sh;
  int64_t out_ss, out_sb, out_sg, out_sh;
};

struct RopeShape {
  int64_t s, b, d, rot;
  int64_t f_ss, f_sb;  // element strides of cos/sin over [s, b] (f_sb = 0: shared)
  int n;               // tensors: 1 to 3
  RopeTensor t[kMaxRopeTensors];
};

template <typename T>
struct RopePtrs {
  const T* in[kMaxRopeTensors];
  T* out[kMaxRopeTensors];
};

constexpr int kRopeThreads = 256;

template <typename T, int VEC>
__global__ void rope_kernel(RopePtrs<T> ptr, const float* __restrict__ cos_f,
                            const float* __restrict__ sin_f, RopeShape sh, bool backward) {
  const int64_t si = blockIdx.x, bi = blockIdx.y;
  const int half = static_cast<int>(sh.rot / 2);
  const int nrot = half / VEC, npass = static_cast<int>((sh.d - sh.rot) / VEC);
  const int per_rot = nrot + npass, per_copy = static_cast<int>(sh.d / VEC);
  const int n0 = static_cast<int>(sh.t[0].h) * (sh.t[0].copy ? per_copy : per_rot);
  const int n1 = sh.n > 1 ? static_cast<int>(sh.t[1].h) * (sh.t[1].copy ? per_copy : per_rot) : 0;
  const int n2 = sh.n > 2 ? static_cast<int>(sh.t[2].h) * (sh.t[2].copy ? per_copy : per_rot) : 0;
  const int it = blockIdx.z * blockDim.x + threadIdx.x;  // this thread's (tensor, head, pack)
  if (it >= n0 + n1 + n2) return;
  const int ti = it < n0 ? 0 : (it < n0 + n1 ? 1 : 2);
  // Selects rather than indexing: a dynamic index into kernel parameters goes through local memory.
  const RopeTensor tt = ti == 0 ? sh.t[0] : (ti == 1 ? sh.t[1] : sh.t[2]);
  const T* in = ti == 0 ? ptr.in[0] : (ti == 1 ? ptr.in[1] : ptr.in[2]);
  T* out = ti == 0 ? ptr.out[0] : (ti == 1 ? ptr.out[1] : ptr.out[2]);
  const int local = it - (ti == 0 ? 0 : (ti == 1 ? n0 : n0 + n1));
  const int per_head = tt.copy ? per_copy : per_rot;
  const int head = local / per_head, k = local - head * per_head;
  const int g = head / static_cast<int>(tt.hpg), hg = head - g * static_cast<int>(tt.hpg);
  const T* src = in + si * tt.in_ss + bi * tt.in_sb + g * tt.in_sg + hg * tt.in_sh;
  T* dst = out + si * tt.out_ss + bi * tt.out_sb + g * tt.out_sg + hg * tt.out_sh;
  if (tt.copy) {
    store_stream<T, VEC>(dst + k * VEC, load_stream<T, VEC>(src + k * VEC));
    return;
  }
  if (k >= nrot) {  // partial rotary: features past rot pass through
    const int j = static_cast<int>(sh.rot) + (k - nrot) * VEC;
    store_stream<T, VEC>(dst + j, load_stream<T, VEC>(src + j));
    return;
  }
  const int j = k * VEC;
  const Pack<T, VEC> p1 = load_stream<T, VEC>(src + j), p2 = load_stream<T, VEC>(src + half + j);
  const int64_t f0 = si * sh.f_ss + bi * sh.f_sb;
  // Forward uses sin(f[j]) for the first half and sin(f[j+half]) for the
  // second; the transpose swaps which sine goes where and flips signs.
  const Pack<float, VEC> c1 = load_pack<float, VEC>(cos_f + f0 + j);
  const Pack<float, VEC> c2 = load_pack<float, VEC>(cos_f + f0 + half + j);
  const Pack<float, VEC> s1 = load_pack<float, VEC>(sin_f + f0 + (backward ? half + j : j));
  const Pack<float, VEC> s2 = load_pack<float, VEC>(sin_f + f0 + (backward ? j : half + j));
  const float sgn = backward ? -1.f : 1.f;
  Pack<T, VEC> o1, o2;
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    const float x1 = static_cast<float>(p1.v[v]), x2 = static_cast<float>(p2.v[v]);
    o1.v[v] = static_cast<T>(x1 * c1.v[v] - sgn * x2 * s1.v[v]);
    o2.v[v] = static_cast<T>(x2 * c2.v[v] + sgn * x1 * s2.v[v]);
  }
  store_stream<T, VEC>(dst + j, o1);
  store_stream<T, VEC>(dst + half + j, o2);
}

}  // namespace

void rope_apply(const std::vector<at::Tensor>& ts, const at::Tensor& cos, const at::Tensor& sin,
                const std::vector<at::Tensor>& outs, bool backward, bool copy_last) {
  TORCH_CHECK(!ts.empty() && ts.size() <= kMaxRopeTensors - (copy_last ? 0 : 1) && outs.size() == ts.size() &&
                  (!copy_last || ts.size() >= 2),
              "rope: expected 1 or 2 tensors to rotate (and with copy_last, one more to copy) and as many "
              "outputs, got ", ts.size(), " and ", outs.size(), " (copy_last = ", copy_last, ")");
  const at::Tensor& t0 = ts[0];
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor &t = ts[i], &out = outs[i];
    TORCH_CHECK(t.is_cuda() && (t.dim() == 4 || t.dim() == 5) && t.stride(-1) == 1,
                "rope: t must be a 4-D [s, b, h, d] or 5-D [s, b, groups, h, d] CUDA view with a contiguous last "
                "dim, got sizes ", t.sizes(), " strides ", t.strides());
    TORCH_CHECK(t.size(0) == t0.size(0) && t.size(1) == t0.size(1) && t.size(-1) == t0.size(-1) &&
                    t.scalar_type() == t0.scalar_type() && t.device() == t0.device(),
                "rope: the tensors must share s, b, d, dtype and device, got ", t.sizes(), " and ",
                t0.sizes());
    TORCH_CHECK(out.sizes() == t.sizes() && out.stride(-1) == 1 && out.scalar_type() == t.scalar_type() &&
                    out.device() == t.device(),
                "rope: out must match t's sizes, dtype and device with a contiguous last dim");
    // Offsets within one (s, b) slice are 32-bit in the kernel.
    for (const at::Tensor* x : {&t, &out}) {
      int64_t last = x->size(-1);
      for (int64_t j = 2; j < x->dim() - 1; ++j) last += (x->size(j) - 1) * x->stride(j);
      TORCH_CHECK(last < (int64_t{1} << 31), "rope: a slice's heads must span below 2^31 elements");
    }
  }
  const int64_t s = t0.size(0), b = t0.size(1), d = t0.size(-1);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.dim() == 3 &&
                  cos.size(0) == s && (cos.size(1) == 1 || cos.size(1) == b) && cos.device() == t0.device(),
              "rope: cos must be a contiguous float32 [s, 1 or b, rot_dim] tensor with s = ", s,
              ", b = ", b, ", got ", cos.sizes(), " ", cos.scalar_type());
  TORCH_CHECK(sin.scalar_type() == at::kFloat && sin.is_contiguous() && sin.sizes() == cos.sizes() &&
                  sin.device() == cos.device(),
              "rope: sin must be a contiguous float32 tensor shaped like cos ", cos.sizes(), ", got ",
              sin.sizes(), " ", sin.scalar_type());
  const int64_t rot = cos.size(2);
  TORCH_CHECK(rot >= 2 && rot % 2 == 0 && rot <= d, "rope: rot_dim must be even and in [2, d = ", d,
              "], got ", rot);
  TORCH_CHECK(b <= 65535, "rope: batch size must be at most 65535, got ", b);
  c10::cuda::CUDAGuard guard(t0.device());
  if (std::all_of(ts.begin(), ts.end(), [](const at::Tensor& t) { return t.numel() == 0; })) return;
  RopeShape sh{s, b, d, rot, cos.stride(0), cos.size(1) == 1 ? 0 : cos.stride(1),
               static_cast<int>(ts.size()), {}};
  int64_t heads = 0, copied = 0;  // rotated heads, copied heads
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor &t = ts[i], &out = outs[i];
    const int64_t copy = copy_last && i + 1 == ts.size();
    if (t.dim() == 4) {  // one group of all the heads
      sh.t[i] = {t.size(2), std::max<int64_t>(t.size(2), 1), copy, t.stride(0), t.stride(1), 0, t.stride(2),
                 out.stride(0), out.stride(1), 0, out.stride(2)};
    } else {
      sh.t[i] = {t.size(2) * t.size(3), std::max<int64_t>(t.size(3), 1), copy, t.stride(0), t.stride(1),
                 t.stride(2), t.stride(3), out.stride(0), out.stride(1), out.stride(2), out.stride(3)};
    }
    (copy ? copied : heads) += sh.t[i].h;
  }
  auto stream = c10::cuda::getCurrentCUDAStream();
  P3D_DISPATCH_FLOATING(t0.scalar_type(), "rope", [&] {
    using T = scalar_t;
    constexpr int V = vec16<T>();
    bool vec = (rot / 2) % V == 0 && (d - rot) % V == 0 && aligned16(cos.data_ptr()) &&
               aligned16(sin.data_ptr());
    RopePtrs<T> ptr{};
    for (size_t i = 0; i < ts.size(); ++i) {
      const at::Tensor &t = ts[i], &out = outs[i];
      vec = vec && aligned16(t.data_ptr()) && aligned16(out.data_ptr());
      for (int j = 0; j < t.dim() - 1; ++j) vec = vec && t.stride(j) % V == 0 && out.stride(j) % V == 0;
      ptr.in[i] = t.data_ptr<T>();
      ptr.out[i] = out.data_ptr<T>();
    }
    auto launch = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const int64_t work = heads * ((rot / 2) / VEC + (d - rot) / VEC) + copied * (d / VEC);
      TORCH_CHECK(work <= int64_t{65535} * kRopeThreads, "rope: heads * head_dim too large: ", work);
      const int threads = work >= kRopeThreads ? kRopeThreads : round_up(work, 32);
      const dim3 grid(static_cast<unsigned>(s), static_cast<unsigned>(b),
                      static_cast<unsigned>((work + threads - 1) / threads));
      rope_kernel<T, VEC><<<grid, threads, 0, stream>>>(ptr, cos.data_ptr<float>(), sin.data_ptr<float>(),
                                                         sh, backward);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    dispatch_vec<T>(vec, launch);
  });
}

}  // namespace p3d
