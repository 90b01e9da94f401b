"""This server as an NVIDIA Dynamo backend (docs/fleet.md, "Dynamo").

`hf_export`: the Hugging Face model folder Dynamo's frontend needs, written from a GGUF and
checked against llama.cpp's tokenizer (needs the `llama` extra and `tokenizers`).
`worker`: `skippy-scheduler dynamo-worker`, the engine in process behind Dynamo's runtime
(needs the `dynamo` extra: see docs/fleet.md for its two-step install). Nothing here imports
Dynamo until a worker starts.
"""
