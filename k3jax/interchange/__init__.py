"""Checkpoint interchange with the Hugging Face layout (safetensors, K3 release names): the
formats, on arrays. Reading and writing run directories, and the k3jax-export / k3jax-import
commands, are programs over the trainer: train/interchange/.

names.py      the release's tensor names / layouts and where each lives in a k3jax model
hf_writer.py  a model's arrays written as an HF checkpoint (streamed, sharded reads)
hf_reader.py  an HF checkpoint checked against the names and read into sharded arrays
mxfp4_pack.py routed experts as compressed-tensors mxfp4-pack-quantized
hf_config.py  config.json of an export
hf_tokenizer.py the tokenizer files beside an export (the byte tokenizer as a tokenizer.json)
foreign.py    Kimi Linear and fla KDAForCausalLM: config mapping and tensor names
errors.py     InterchangeError
"""

from k3jax.interchange.errors import InterchangeError

__all__ = ["InterchangeError"]
