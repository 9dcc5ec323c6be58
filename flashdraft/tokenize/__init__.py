"""tokenize: completions → Arrow training shards with token-exact loss masks, a quality gate, at tokenizer speed.

    flashdraft tokenize --input work/generate --out work/dataset [--tokenizer REF] [--workers N]
    flashdraft tokenize --out work/dataset --show 3        # print samples, supervised tokens highlighted

Each conversation is rendered with the target's own chat template, exactly as serving renders it, and
tokenized once. The loss mask comes from render boundaries, not from searching the text: for a trained
assistant turn i, the template's rendering of turns [:i] with the generation prompt is a prefix of the
rendering of turns [:i+1], so the turn's characters are [len(before), len(through)); the fast tokenizer maps
those character boundaries to token indices (`char_to_token`; for byte-level BPE computed from the token ids,
see `token_offsets`). Supervised = those tokens up to and including the end-of-turn token; the scaffolding
after it (a newline) is not. Tokens are never re-encoded per prefix.

Output: the `datasets.save_to_disk` layout (`datasets.load_from_disk` opens it) with columns `id`,
`input_ids` (int32), `loss_mask` (uint8), `num_tokens`, `prompt_opening` (a key of the first user turn's first
words: train holds out samples whose key no other sample shares); manifest stats `samples`, `tokens`, `loss_tokens`,
`loss_fraction`, `rejected`, `truncated` (samples cut at `max_length`) with `truncated_tokens` (the tokens cut
away), `length_capped` (completions generate stopped at `max_new_tokens`: kept, their template-added end-of-turn
unsupervised, or dropped with `length_capped: drop`), `anchor_valid_samples`, a length histogram and per-shard stats,
`longest`, `largest_token_id`; `token_counts.safetensors` counts each token id (in all and where supervised).
"""

from flashdraft.tokenize.stage import run, show

__all__ = ["run", "show"]
