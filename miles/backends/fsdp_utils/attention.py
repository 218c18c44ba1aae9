"""The kernels behind packed (varlen) attention, and the choice among them (the attention function itself, the
"miles_varlen" implementation HF models call, is packed_attention.py).

`select_attention_kernel` maps --attn-implementation onto a backend (`set_varlen_backend`); each name runs its own
kernel:
- "sdpa" (CPU, and CUDA with --attn-implementation sdpa/eager): bucketed `scaled_dot_product_attention` calls
  (packed_attention.py);
- "flash" (flash_attention_2; miles_varlen on CUDA, "auto"): FlashAttention-2's `flash_attn_varlen_func`
  (package flash-attn, module `flash_attn`) over the whole row; "auto" without flash-attn takes torch's own flash
  varlen kernel (`torch_varlen_func`);
- "flash3" (flash_attention_3): FlashAttention-3's `flash_attn_varlen_func` (module `flash_attn_interface`,
  built from flash-attention's hopper/ directory; not on PyPI);
- context parallel (see context_parallel.py): ring-flash-attn's llama3 varlen kernel with FlashAttention-2 on
  CUDA, all-gathered K/V with a block-diagonal causal mask in plain torch otherwise.

Every flash kernel is adapted to one signature (`VarlenKernel`) and imported once per backend (`varlen_kernel`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable

import torch

__all__ = [
    "VarlenKernel",
    "flash_attn_installed",
    "select_attention_kernel",
    "set_varlen_backend",
    "torch_varlen_func",
    "use_flash_kernel",
    "varlen_backend",
    "varlen_kernel",
]

# f(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale) -> out: causal (bottom-right aligned),
# q [Tq, H, D], k/v [Tk, Hkv, D], cu_* [n+1] int32
VarlenKernel = Callable[..., torch.Tensor]

_BACKENDS = ("auto", "sdpa", "flash", "flash3")
_backend = os.environ.get("MILES_VARLEN_BACKEND", "auto")
_kernels: dict[str, VarlenKernel] = {}  # the backend's varlen kernel, imported once (varlen_kernel)

# what each flash backend imports, and how to get it
FA2_MODULE, FA2_INSTALL = "flash_attn", "the flash-attn package: pip install 'miles[gpu]'"
FA3_MODULE, FA3_INSTALL = (
    "flash_attn_interface",
    "FlashAttention-3, which is not on PyPI: build it from flash-attention's hopper/ directory "
    "(cd hopper && pip install --no-build-isolation .)",
)


def set_varlen_backend(name: str) -> None:
    """Choose the kernel: "auto" (FlashAttention-2 on CUDA, SDPA on CPU), "sdpa" (always), "flash"
    (FlashAttention-2, CUDA only), "flash3" (FlashAttention-3, CUDA only).

    The default comes from the environment variable MILES_VARLEN_BACKEND, else "auto".
    """
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"varlen attention backend {name!r} is not one of {_BACKENDS}")
    _backend = name
    _kernels.clear()


def varlen_backend() -> str:
    """The backend chosen by `set_varlen_backend` (or MILES_VARLEN_BACKEND)."""
    return _backend


def use_flash_kernel(query: torch.Tensor) -> bool:
    """Whether the varlen kernels should run flash-attn (2 or 3) for `query` under the current backend choice."""
    if _backend in ("flash", "flash3") and not query.is_cuda:
        raise ValueError(f"MILES_VARLEN_BACKEND={_backend} needs CUDA tensors; use 'sdpa' or 'auto' on CPU")
    return _runs_flash(query.is_cuda)


def _runs_flash(is_cuda: bool) -> bool:
    return _backend in ("flash", "flash3") or (_backend == "auto" and is_cuda)


def select_attention_kernel(attn_implementation: str, is_cuda: bool, cp_size: int = 1) -> None:
    """--attn-implementation picks the kernel behind the packed (varlen) attention every training forward uses,
    and the packages it needs are imported now (at model build), so a missing one fails before the first step:

    - flash_attention_2 -> FlashAttention-2 varlen (`flash_attn`, the `gpu` extra), CUDA only;
    - flash_attention_3 -> FlashAttention-3 varlen (`flash_attn_interface`), CUDA only, no context parallelism
      (ring-flash-attn's kernels are FlashAttention-2's);
    - miles_varlen -> FlashAttention-2 on CUDA where installed, else torch's own flash varlen kernel
      (`torch.nn.attention.varlen`); SDPA on CPU; sdpa/eager -> bucketed SDPA.

    With cp_size > 1 and FlashAttention-2, context-parallel attention runs ring-flash-attn (imported here too).
    """
    if attn_implementation in ("flash_attention_2", "flash_attention_3"):
        if not is_cuda:
            raise ValueError(
                f"--attn-implementation {attn_implementation} needs a CUDA device; on CPU use "
                "--attn-implementation sdpa"
            )
        if attn_implementation == "flash_attention_3" and cp_size > 1:
            raise ValueError(
                "--attn-implementation flash_attention_3 has no context-parallel kernel (ring-flash-attn runs "
                "FlashAttention-2's); use flash_attention_2 with --context-parallel-size > 1"
            )
        set_varlen_backend("flash" if attn_implementation == "flash_attention_2" else "flash3")
    elif attn_implementation == "miles_varlen":
        set_varlen_backend("auto")
    else:
        set_varlen_backend("sdpa")
    if _runs_flash(is_cuda):
        varlen_kernel()
        if cp_size > 1 and (_backend != "auto" or flash_attn_installed()):
            from miles.backends.fsdp_utils.context_parallel import import_ring_kernels

            import_ring_kernels()


def flash_attn_installed() -> bool:
    """Whether FlashAttention-2 (`flash_attn`) is importable: already imported (or stood in for), else looked up
    without importing it."""
    if "flash_attn" in sys.modules:
        return sys.modules["flash_attn"] is not None
    return importlib.util.find_spec("flash_attn") is not None


def _import_flash_varlen() -> VarlenKernel:
    """The backend's varlen kernel as f(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale) -> out,
    causal (bottom-right aligned), q [Tq, H, D], k/v [Tk, Hkv, D]."""
    if _backend == "flash3":
        try:
            from flash_attn_interface import flash_attn_varlen_func as fa3_varlen
        except ImportError as e:
            raise ImportError(
                f"--attn-implementation flash_attention_3 runs FlashAttention-3 (module {FA3_MODULE}), which is "
                f"not importable ({e}); install {FA3_INSTALL}, or use flash_attention_2"
            ) from e

        def fa3(
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            cu_q: torch.Tensor,
            cu_k: torch.Tensor,
            max_q: int,
            max_k: int,
            dropout_p: float,
            softmax_scale: float | None,
        ) -> torch.Tensor:
            if dropout_p:
                raise ValueError(f"FlashAttention-3 has no attention dropout (got {dropout_p})")
            out = fa3_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=True)
            return out[0] if isinstance(out, tuple) else out  # FA3 betas return (out, softmax_lse)

        return fa3
    try:
        from flash_attn import flash_attn_varlen_func as fa2_varlen
    except ImportError as e:
        # miles_varlen ("auto") takes torch's own flash varlen kernel where flash-attn is missing;
        # flash_attention_2 named means FlashAttention-2 run
        torch_varlen = torch_varlen_func() if _backend == "auto" else None
        if torch_varlen is not None:
            return torch_varlen
        raise ImportError(
            f"miles_varlen attention with FlashAttention-2 (module {FA2_MODULE}) on CUDA: not importable ({e}); "
            f"install {FA2_INSTALL} (or use --attn-implementation sdpa / MILES_VARLEN_BACKEND=sdpa)"
        ) from e

    def fa2(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        dropout_p: float,
        softmax_scale: float | None,
    ) -> torch.Tensor:
        return fa2_varlen(
            q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=True
        )

    return fa2


def torch_varlen_func() -> VarlenKernel | None:
    """torch's built-in flash-attention varlen kernel as a `VarlenKernel` (causal; q/k/v [T, H, D], cu_seqlens,
    max lengths, `dropout_p`, `softmax_scale`), or None when this torch has none. Its signature changed between releases (`is_causal` vs `window_size`, `scale`, `enable_gqa`): the
    adapter passes what the installed one takes. GQA (fewer K/V heads) is native to the kernel."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    import inspect

    params = inspect.signature(varlen_attn).parameters

    def call(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
    ) -> torch.Tensor:
        if dropout_p:
            raise ValueError(
                "torch's varlen attention has no dropout; use flash-attn or MILES_VARLEN_BACKEND=sdpa"
            )
        kwargs: dict[str, bool | float | tuple[int, int]] = (
            {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        )
        if softmax_scale is not None:
            if "scale" not in params:
                raise ValueError("this torch's varlen_attn takes no scale; use flash-attn")
            kwargs["scale"] = softmax_scale
        if "enable_gqa" in params and q.shape[1] != k.shape[1]:
            kwargs["enable_gqa"] = True
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)

    return call


def varlen_kernel() -> VarlenKernel:
    """`_import_flash_varlen` once per backend (each layer of every forward asks; a failed import or a signature
    inspection per layer costs host time the GPU waits for)."""
    kernel = _kernels.get(_backend)
    if kernel is None:
        kernel = _kernels[_backend] = _import_flash_varlen()
    return kernel
