"""eval: lossless DFlash speculative decoding, and the acceptance-length report users judge a drafter by.

    flashdraft eval --drafter work/train/drafter --prompts builtin:chat-heldout --out work/eval

One decoding step (`SpecDecoder.generate`): the drafter proposes K−1 tokens in one pass from
[anchor, MASK…] over its cached context; the target verifies [anchor, drafts] in one pass; the longest
matching prefix is accepted plus the target's own next token (the bonus, the next anchor); the target's KV
cache is cropped to what was accepted and the accepted positions' features are appended to the drafter's
context cache. Greedy output is checked against target-only greedy decoding, token for token or, where
the two first differ, at a near-tie of the target's own logits (`divergence`: bfloat16 rounding); with
temperature > 0, drafts are accepted with probability min(1, p/q) and rejections resampled from (p − q)+, so
every emitted token is a sample of the target's distribution.

Where each piece lives: `stage` (the run), `prepare` (target, drafter, decoder), `turns` (eval's own decoding and
its report), `in_engines` (each engine's τ beside it: engines.py, engine_commands.py), `spread` (τ's standard error
at temperature > 0), `decode` and `static` (the decoders), `report` (tables and plots), `sets` (the prompt sets).

What it decodes (evaluate/sets.py): one or more prompt sources — built-in sets, prompt files, and the public
benchmark sets the anchors report τ on (gsm8k, math500, humaneval, mbpp, mt-bench, formatted as z-lab's benchmark
formats them; mt-bench's second turn follows the target's own first answer). How (evaluate/static.py): on a
static KV cache with CUDA graphs where the device and target allow, both the speculative decoding and the
target-only baseline it is timed against.

Report (`report.json`, `report.md`, PNG plots, manifest stats): per dataset and overall, `acceptance_length` τ
(tokens per target verify pass), acceptance rate by block position, τ histogram, tokens/s and `speedup` against
target-only decoding and against prompt-lookup decoding, lossless; per prompt category; the thinking mode,
temperature and decoding machinery they were measured with. `report.md` (also printed) is the table of it.
"""

from flashdraft.evaluate.stage import run

__all__ = ["run"]
