"""Ahead-of-time compile of a Triton launch for a CUDA target without a GPU, specialised exactly
as the runtime JIT would: the JIT's own binder decides which arguments become constexprs (an int
equal to 1) and which get divisibility hints (pointers and ints divisible by 16). Reports register
spills (cuobjdump's STACK) and shared memory, so tests catch compile errors and spills on CPU."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path


def have_ptxas() -> bool:
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


def aot_compile(kernel, args: tuple, meta: dict, arch: int = 90, num_warps: int = 4) -> tuple[int, int]:
    """Compile kernel[grid](*args, **meta, num_warps=…) for sm_<arch> → (stack bytes, shared bytes).
    Arguments may be meta-device tensors (their data_ptr 0 is 16-aligned, as real ones are)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kw = dict(meta, num_warps=num_warps)
    bound, specialization, options = binder(*args, **kw)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kw, bound, specialization, options)
    ck = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                        options=options.__dict__)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"lynx_aot_{os.getpid()}.cubin"
    cubin.write_bytes(ck.asm["cubin"])
    try:
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
    finally:
        cubin.unlink()
    return int(re.search(r"STACK:(\d+)", usage).group(1)), ck.metadata.shared


def specialised_constexprs(kernel, args: tuple, meta: dict) -> dict:
    """name → value of the arguments the JIT turns into constexprs for these args (test helper)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    _, specialization, _ = binder(*args, **meta)
    names = [p.name for p in kernel.params]
    return {n: s[1] for n, s in zip(names, specialization) if s[0] == "constexpr" and n not in meta}
