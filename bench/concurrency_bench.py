"""Can anything run beside a cuBLAS GEMM on this GPU? The question behind every TP overlap (issue 26).

    torchrun --standalone --nproc-per-node 2 bench/concurrency_bench.py [--json-out F]

Each row is the median of --iters CUDA-event timings (after --warmup) of one operation on the current
stream, alone and "beside a GEMM": an 8192^3 bf16 GEMM launched just before it on another stream. An
operation that truly runs beside the GEMM keeps its alone time; one that waits for it takes the GEMM's.
- a tiny elementwise kernel (4 KiB), also with SMs carved out of the GEMM (nccl_bench.sm_carveout, which
  routes the GEMMs through cuBLASLt: torch's default cuBLAS path ignores a carveout) and from a
  high-priority stream;
- a 16 MiB copy to the peer GPU's memory (the copy engine, no SMs), and one within the GPU (which waits);
- a 16 MiB-per-rank all-gather and reduce-scatter through NCCL (kernels) and through torch's
  copy-engine collectives (symmetric memory's _low_contention_* ops: copy-engine copies between
  barriers that are kernels);
- with 2 ranks, a 16 MiB-per-rank all-gather made only of copy-engine copies and stream memory
  operations (each rank copies its shard into the peer's symmetric buffer, then writes a sequence
  number into the peer's signal pad with cuStreamWriteValue32; the peer's stream waits for it with
  cuStreamWaitValue32): no kernel at all, what Transformer Engine's userbuffers do.
"""
from __future__ import annotations

import argparse
import ctypes
import os

import torch
import torch.distributed as dist

from nccl_bench import emit_result, sm_carveout, time_ms  # bench/ is this script's directory


def stream_wait_value32(address: int, value: int) -> None:
    """The current stream waits until the uint32 at device ``address`` is >= ``value`` (no kernel)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    wait = getattr(cuda, "cuStreamWaitValue32_v2", None) or cuda.cuStreamWaitValue32
    wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    rc = wait(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), address, value, 0)  # 0: GEQ
    if rc != 0:
        raise RuntimeError(f"cuStreamWaitValue32 returned CUDA error {rc}")


def signalled_all_gather(shard: torch.Tensor, group) -> "callable":
    """A 2-rank all-gather of ``shard`` (1-D) with copy-engine copies and stream memory operations only."""
    import torch.distributed._symmetric_memory as symm_mem
    from torch._C._distributed_c10d import _SymmetricMemory

    rank, n = dist.get_rank(group), shard.numel()
    peer = 1 - rank
    buf = symm_mem.empty(2 * n, dtype=shard.dtype, device=shard.device)
    handle = symm_mem.rendezvous(buf, group.group_name)
    words = handle.signal_pad_size // 4
    flag = words - 1  # the last word of the pad: the barriers use the first ones
    peer_slot = handle.get_buffer(peer, (2 * n,), shard.dtype)[rank * n:(rank + 1) * n]
    peer_pad = handle.get_signal_pad(peer, (words,), torch.uint32)
    my_flag_address = handle.signal_pad_ptrs[rank] + 4 * flag
    out = torch.empty(2 * n, dtype=shard.dtype, device=shard.device)
    seq = [0]

    def run() -> torch.Tensor:
        seq[0] += 1
        peer_slot.copy_(shard)  # into the peer's buffer: the copy engine
        _SymmetricMemory.stream_write_value32(peer_pad, flag, seq[0])  # fenced after the copy
        out[rank * n:(rank + 1) * n].copy_(shard)
        stream_wait_value32(my_flag_address, seq[0])  # the peer's shard has arrived in buf
        out[peer * n:(peer + 1) * n].copy_(buf[peer * n:(peer + 1) * n])
        return out

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    group = dist.group.WORLD
    high = torch.cuda.Stream(priority=-1)
    mat = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.backends.cuda.preferred_blas_library("cublaslt")  # every GEMM on the path the carveout row needs

    def gemm(carveout=None):
        sm_carveout(carveout)
        mat @ mat
        sm_carveout(None)

    def timed(fn, beside=None) -> float:
        return time_ms(fn, a.iters, a.warmup, beside)

    tiny = torch.randn(1024, device="cuda")

    def tiny_kernel():
        tiny.mul_(1.0001)

    def tiny_on_high_priority():
        high.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(high):
            tiny_kernel()
        torch.cuda.current_stream().wait_stream(high)

    rows = {"GEMM 8192^3 alone": timed(gemm),
            "tiny kernel alone": timed(tiny_kernel),
            "tiny kernel beside a GEMM": timed(tiny_kernel, gemm),
            "tiny kernel beside a GEMM leaving 66 SMs free": timed(tiny_kernel, lambda: gemm(66)),
            "tiny kernel, high-priority stream, beside a GEMM": timed(tiny_on_high_priority, gemm)}
    if world > 1:
        shard = torch.randn(8 * 2 ** 20, device="cuda", dtype=torch.bfloat16)
        peer = torch.empty_like(shard, device=f"cuda:{(torch.cuda.current_device() + 1) % torch.cuda.device_count()}")
        rows["16 MiB copy to the peer GPU alone"] = timed(lambda: peer.copy_(shard, non_blocking=True))
        rows["16 MiB copy to the peer GPU beside a GEMM"] = timed(lambda: peer.copy_(shard, non_blocking=True), gemm)
        local = torch.empty_like(shard)
        rows["16 MiB copy within the GPU alone"] = timed(lambda: local.copy_(shard))
        rows["16 MiB copy within the GPU beside a GEMM"] = timed(lambda: local.copy_(shard), gemm)
        shard2d = shard.view(-1, 1024)
        full = torch.randn(world * shard2d.size(0), 1024, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(full)
        import torch.distributed._symmetric_memory as symm_mem
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group.group_name)
        wait = torch.ops._c10d_functional.wait_tensor
        ops = {"NCCL all-gather": lambda: dist.all_gather_into_tensor(out, shard2d),
               "NCCL reduce-scatter": lambda: dist.reduce_scatter_tensor(shard2d, full),
               "copy-engine all-gather": lambda: wait(torch.ops.symm_mem._low_contention_all_gather(
                   shard2d, group.group_name)),
               "copy-engine reduce-scatter": lambda: wait(torch.ops.symm_mem._low_contention_reduce_scatter(
                   full, "sum", group.group_name))}
        if world == 2:
            try:
                ag = signalled_all_gather(shard, group)
                expected = torch.empty(2 * shard.numel(), dtype=shard.dtype, device="cuda")
                dist.all_gather_into_tensor(expected, shard)
                rows["signalled copy-engine all-gather equals NCCL's"] = float(torch.equal(ag(), expected))
                ops["signalled copy-engine all-gather"] = ag
            except Exception as e:  # noqa: BLE001 - report and go on with the other rows
                print(f"rank {rank}: signalled copy-engine all-gather unavailable: {e!r}")
        for name, op in ops.items():
            rows[f"{name} (16 MiB a rank) alone"] = timed(op)
            rows[f"{name} beside a GEMM"] = timed(op, gemm)
    if rank == 0:
        print(f"{torch.cuda.get_device_name()}, {world} ranks, torch {torch.__version__}")
        for name, ms in rows.items():
            print(f"{name:55s} {ms:8.3f} ms")
        emit_result(rows, a.json_out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
