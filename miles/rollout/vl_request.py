"""The image part of a /generate request, as SGLang 0.5.23's `GenerateReqInput` takes it with `input_ids`.

A sample with images carries them in `Sample.multimodal_data` (`{"image": [data URI, ...]}`, base64 PNG
`data:image/png;base64,...` URIs) and its prompt ids are the processor's *expanded* ids: `<|image_pad|>` repeated
once per merged patch of each image. SGLang's multimodal processor expands the pads itself from `image_data`: with
`input_ids` it decodes them to text and runs the checkpoint's processor, which requires exactly one `<|image_pad|>`
per image (with `SGLANG_MM_AVOID_RETOKENIZE`, `_expand_input_ids` keeps the ids and expands each single pad, with
the same rule). So the request carries the prompt with each image's run of pads collapsed to one pad, and the
images in order:

    single:  {"input_ids": [...one pad per image...], "image_data": ["data:image/png;base64,...", ...], ...}
    batch:   {"input_ids": [[...], [...]], "image_data": [[uri, ...], [], ...], ...}   ([] for a text-only prompt)

SGLang (and the embedded engine, `miles.engines.local.vl_runner`) expands the pads again from the images, to the
same ids the sample holds when its image processor config is the checkpoint's; the answer's `output_ids` follow.
The first runs of pads, one per image, are collapsed: the prompt's, then those of multi-turn tool results that
carry images (`miles.rollout.multi_turn`), whose images follow the prompt's in `multimodal_data`, as a multi-turn
conversation's images go to SGLang; pads after them (sampled by the policy, in a continued generation) go as is.
See docs/sglang-contract.md.
"""

from __future__ import annotations

from typing import Any

IMAGE_PAD = "<|image_pad|>"


def collapse_image_pads(ids: list[int], pad_id: int, max_runs: int | None = None) -> tuple[list[int], int]:
    """`ids` with every run of `pad_id` shortened to one (only the first `max_runs` runs when given: later pads
    are kept as they are); returns (ids, number of runs shortened)."""
    out: list[int] = []
    runs = 0
    in_run = False
    for t in ids:
        if t == pad_id and in_run:
            continue
        in_run = t == pad_id and (max_runs is None or runs < max_runs)
        runs += in_run
        out.append(t)
    return out, runs


def sample_images(sample: Any) -> list[str]:
    """The images of a sample (`Sample.multimodal_data["image"]`; none when absent)."""
    data = getattr(sample, "multimodal_data", None) or {}
    images = data.get("image") or []
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise ValueError(
            f"sample {getattr(sample, 'index', '?')}: multimodal_data['image'] must be a list of str"
        )
    extra = sorted(set(data) - {"image"})
    if extra:
        raise ValueError(
            f"sample {getattr(sample, 'index', '?')}: multimodal_data {extra} not supported (image only)"
        )
    return images


def engine_prompt(sample: Any, tokenizer: Any) -> tuple[list[int], list[str] | None]:
    """(input_ids, image_data) of the /generate request for `sample`: its tokens as they are and None without
    images; with images, the prompt's pad runs collapsed (one pad per image) and the image URIs."""
    tokens = list(sample.tokens)
    images = sample_images(sample)
    if not images:
        return tokens, None
    pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    if pad_id is None or pad_id == tokenizer.unk_token_id:
        raise ValueError(f"sample {sample.index} has images but the tokenizer has no {IMAGE_PAD} token")
    ids, runs = collapse_image_pads(tokens, pad_id, len(images))
    if runs != len(images):
        raise ValueError(
            f"sample {sample.index}: its tokens have {runs} runs of {IMAGE_PAD} but {len(images)} images"
        )
    return ids, images


def image_data_field(per_request: list[list[str] | None], single: bool) -> dict[str, Any]:
    """The `image_data` entry of a /generate body: nothing when no request has images; a list of a single
    request's images; one list per request of a batch ([] for a text-only one: SGLang's batch normalization
    needs every entry a list once the first is)."""
    if not any(per_request):
        return {}
    if single:
        return {"image_data": list(per_request[0] or [])}
    return {"image_data": [list(images or []) for images in per_request]}
