"""generate: regenerate every prompt's response with the target — resumable, shardable, nothing lost.

    flashdraft generate --prompts prompts.jsonl --out work/generate [--backend hf|openai|vllm]
    flashdraft generate --prompts p.jsonl --out gen-0 --shard-index 0 --num-shards 4 --upload-to s3://b/run/gen-0

Output artifact (kind `completions`):
    batch-000000.jsonl …    one record per prompt, each file committed atomically as its batch finishes
    batch-000000.errors.jsonl  requests that failed after retries (only where there were some)
    errors.jsonl            all of those, merged        rejected.jsonl  input lines that are not prompts
    manifest.json           written last; stats `records`, `errors`, `rejected`, `truncated`, `completion_tokens`

A rerun skips committed batches, so after a crash at any moment it ends with exactly one record per prompt.
"""

from flashdraft.generate.stage import run

__all__ = ["run"]
