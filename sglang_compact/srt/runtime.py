"""What the compact backend builds once, at start, for one model runner."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sglang_compact.batch import cdiv
from sglang_compact.compact import CompactAttention
from sglang_compact.config import OBSERVING_LAYER, CompactConfig
from sglang_compact.executors import TorchExecutor, make_flashinfer_executor
from sglang_compact.gate import Gate, ModelShape
from sglang_compact.summaries import PageSummaries
from sglang_compact.srt import alignment, compat
from sglang_compact.srt.model_checks import (UnsupportedModelError, check_attention_layers, check_runner,
                                             check_search_kernel, check_server_features, config_for)
from sglang_compact.srt.prompt_notes import NOTES
from sglang_compact.srt.telemetry import CompactTelemetry, metrics_for

logger = logging.getLogger(__name__)


def is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def resolve_prefill_kernel(config: CompactConfig, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The rows' kernel for `config.prefill_kernel` on this device: "fa2", "fa3" (rows on FlashInfer's fa3 even
    when their lengths vary: planned per layer), "fa3-auto" (fa3 where one plan serves every layer, fa2 rows
    otherwise) or "sgl-fa3" (sgl_kernel's FA3, planned once). "auto" takes sgl-fa3 where it runs: on the H100 it
    was 4% faster than FlashInfer's fa3 rows at 128K and no slower at 32K (docs/results/rows_sgl_fa3/), and it
    plans once for every selector; else FlashInfer's kernels."""
    from sglang_compact.executors import sgl_fa3
    hopper = is_hopper(device)
    want = config.prefill_kernel
    if want == "sgl-fa3":
        why = sgl_fa3.unavailable_reason(device, dtype, head_dim)
        if why is not None:
            raise UnsupportedModelError(f"--compact-prefill-kernel sgl-fa3: {why}; use auto, fa2 or fa3")
        return want
    if want == "auto":
        if not hopper or dtype == torch.float32:
            return "fa2"
        return "sgl-fa3" if sgl_fa3.unavailable_reason(device, dtype, head_dim) is None else "fa3-auto"
    if want == "fa3":
        if not hopper:
            raise UnsupportedModelError("--compact-prefill-kernel fa3 needs a Hopper (sm90) GPU: use auto or fa2")
        if dtype == torch.float32:
            raise UnsupportedModelError("--compact-prefill-kernel fa3 needs a bf16 or fp16 KV cache: use auto or fa2")
        if not (config.spec.fixes_row_lengths or config.spec.fixes_rows_at_observing_layer(config.params)):
            logger.warning("sglang_compact: --compact-prefill-kernel fa3 with selector %r plans every layer from "
                           "host copies of the row lengths (a device->host sync per layer); auto plans once",
                           config.selector)
    return want


def resolve_dense_kernel(config: CompactConfig, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The kernel of dense passes for `config.dense_kernel` on this device: "sgl-fa3" or "flashinfer"."""
    from sglang_compact.executors import sgl_fa3
    want = config.dense_kernel
    if want == "flashinfer":
        return want
    why = sgl_fa3.unavailable_reason(device, dtype, head_dim)
    if why is None:
        return "sgl-fa3"
    if want == "sgl-fa3":
        raise UnsupportedModelError(f"--compact-dense-kernel sgl-fa3: {why}; use auto or flashinfer")
    if is_hopper(device):
        logger.warning("sglang_compact: dense passes run on FlashInfer, not on the FA3 kernel stock SGLang runs by "
                       "default on Hopper: %s", why)
    return "flashinfer"


def check_layer_rows(config: CompactConfig, view: compat.RunnerView, planned_once: bool,
                     selector_layers: tuple[int, ...] = ()) -> None:
    """Layers whose rows differ from the pass's plan against the model and the rows' plan: those the
    selector's own per-layer parameters name (`Selector.own_layers`), and `--compact-dense-layers`. Their rows'
    lengths differ from the other layers', so the rows need a plan made with bounds (fa2) or FA3's lengths read on the
    device (sgl-fa3)."""
    if selector_layers:
        if planned_once:
            raise UnsupportedModelError(f"selector {config.selector!r} with per-layer parameters (layers "
                                        f"{','.join(map(str, selector_layers))}): its rows' lengths differ between "
                                        "layers, so they cannot run on fa3 planned once per forward pass: add "
                                        "--compact-prefill-kernel fa2 (or sgl-fa3 on Hopper)")
        bad = [x for x in selector_layers if x >= view.model_layers]
        if bad:
            raise UnsupportedModelError(f"--compact-selector-params: layers {bad} are not among the model's "
                                        f"{view.model_layers} layers (0-{view.model_layers - 1})")
    check_dense_layers(config, view, planned_once)


def check_dense_layers(config: CompactConfig, view: compat.RunnerView, planned_once: bool) -> None:
    """`--compact-dense-layers` against the model and the rows' plan: ids of this model's layers, none of this
    rank's first layers up to its observing one, and rows whose lengths a layer may change."""
    dl = config.dense_layers
    if not dl:
        return
    if dl[-1] >= view.model_layers:
        raise UnsupportedModelError(f"--compact-dense-layers {','.join(map(str, dl))}: the model has "
                                    f"{view.model_layers} layers (0-{view.model_layers - 1})")
    own = range(view.start_layer, view.start_layer + OBSERVING_LAYER + 1)
    if any(x in own for x in dl):
        raise UnsupportedModelError(f"--compact-dense-layers: layers {own.start}-{own.stop - 1} are this pipeline "
                                    "stage's first layers (the first reads every page when a pass observes its "
                                    "density, the next observes): give later layers")
    if planned_once:
        raise UnsupportedModelError(f"--compact-dense-layers with selector {config.selector!r}: its rows run on fa3, "
                                    "planned once from their lengths, which a layer reading every page would "
                                    "change: add --compact-prefill-kernel fa2 (or sgl-fa3 on Hopper)")


@dataclass
class CompactRuntime:
    config: CompactConfig
    view: compat.RunnerView
    pool: object
    req_to_token: torch.Tensor
    num_q_heads: int
    sm_scale: float
    compact: CompactAttention
    gate: Gate
    executor: object
    kernel: str
    summaries: PageSummaries | None
    telemetry: CompactTelemetry
    window_pages: int

    @property
    def device(self) -> torch.device:
        return self.view.device

    @property
    def is_cuda(self) -> bool:
        return self.view.device.type == "cuda"

    @property
    def max_pages_per_req(self) -> int:
        return cdiv(self.view.context_len + self.view.page_size, self.view.page_size)

    @classmethod
    def from_runner(cls, model_runner) -> "CompactRuntime":
        view = compat.runner_view(model_runner)
        config = config_for(compat.attached_config(model_runner.server_args), view.page_size).at_chunk(
            view.chunked_prefill_size)
        check_runner(view)
        check_search_kernel(config, view.device.type)
        check_server_features(model_runner.server_args)
        h_q, scale = check_attention_layers(compat.attention_layers(model_runner.model), view.num_kv_heads,
                                            view.head_dim)
        compact = CompactAttention(config)
        window = config.window_tokens(view.chunked_prefill_size)
        chunk = view.chunked_prefill_size
        if chunk and chunk > 0 and chunk % window:
            raise UnsupportedModelError(f"--chunked-prefill-size {chunk} is not a multiple of the union window "
                                        f"({window} tokens): use a multiple, or set --compact-union-window to a "
                                        f"divisor of it")
        if view.device.type == "cuda":
            kernel = resolve_prefill_kernel(config, view.device, view.kv_dtype, view.head_dim)
            dense_kernel = resolve_dense_kernel(config, view.device, view.kv_dtype, view.head_dim)
            # a pass has at most max_tokens / W + max_requests windows (a chunk's ends may be partial windows)
            max_windows = cdiv(view.chunked_prefill_size or view.context_len, window) + view.max_requests
            max_rows = view.num_kv_heads * max_windows
            max_indices = max_rows * cdiv(view.context_len + view.page_size, view.page_size)
            executor = make_flashinfer_executor(kernel, view.device, max_rows=max_rows, max_indices=max_indices,
                                                dense_fa3=dense_kernel == "sgl-fa3")
            device_name = torch.cuda.get_device_name(view.device)
            props = torch.cuda.get_device_properties(view.device)
            capability, multiprocessors = f"{props.major}.{props.minor}", props.multi_processor_count
        else:
            kernel, dense_kernel, executor, device_name = "torch", "torch", TorchExecutor(), None
            capability, multiprocessors = "", 0
        shape = ModelShape(h_q, view.num_kv_heads, view.head_dim, view.page_size)
        fixed = config.spec.fixes_row_lengths or config.spec.fixes_rows_at_observing_layer(config.params)
        # the cost model prices sgl_kernel's FA3 rows as FlashInfer's fa3 rows until it is calibrated for them
        rows_kernel = "fa3" if kernel in ("fa3", "sgl-fa3") or (kernel == "fa3-auto" and fixed) else "fa2"
        # FA3's rows read their lengths on the device: layers may differ in their rows' lengths
        check_layer_rows(config, view, planned_once=kernel != "sgl-fa3" and rows_kernel == "fa3" and fixed,
                         selector_layers=compact.selector.own_layers())
        dense_cost_kernel = "fa3" if kernel in ("fa3", "fa3-auto", "sgl-fa3") else "fa2"
        gate = Gate.for_server(config, shape, view.chunked_prefill_size, device_name, dense_cost_kernel,
                               view.context_len, rows_kernel,
                               num_layers=view.num_layers, capability=capability, multiprocessors=multiprocessors)
        summaries = None
        if compact.uses_summaries and not gate.decision.never:
            summaries = PageSummaries(view.num_layers, view.num_pages, view.num_kv_heads, view.head_dim, view.device,
                                      key_bounds=compact.uses_key_bounds, bounds_dtype=view.kv_dtype)
        metrics = metrics_for(view.enable_metrics, view.metric_labels, view.num_layers,
                              None if gate.decision.never else gate.decision.min_context, gate.dense_above)
        if config.recall_every and metrics is None:
            logger.warning("sglang_compact: --compact-recall-every %d is read through /metrics: add --enable-metrics "
                           "(nothing is measured without it, unless debug logging is on)", config.recall_every)
        NOTES.enable()
        alignment.activate(gate)
        rt = cls(config, view, compat.kv_pool(model_runner), compat.req_to_token(model_runner), h_q, scale, compact,
                 gate, executor, kernel, summaries, CompactTelemetry(view.num_layers, metrics),
                 window // view.page_size)
        logger.info("sglang_compact: %s; %d/%d heads x %d, page %d, prefill kernel %s (dense passes %s), summaries "
                    "%s; gate: %s", config.describe(), h_q, view.num_kv_heads, view.head_dim, view.page_size, kernel,
                    dense_kernel,
                    "on" if summaries is not None else "off", gate.describe())
        return rt

    def page_table(self, req_pool_indices: torch.Tensor, n_pages: int) -> torch.Tensor:
        """int32 [B, n_pages]: page ids of each request's first n_pages pages (garbage past its own)."""
        P = self.view.page_size
        pos = (torch.arange(max(n_pages, 1), device=self.req_to_token.device) * P).clamp(
            max=self.req_to_token.shape[1] - 1)
        slots = self.req_to_token[req_pool_indices.long()[:, None], pos[None, :]]
        return torch.div(slots, P, rounding_mode="floor").to(torch.int32)
