"""The engine: request -> scheduler decision -> batch tensors -> model -> sampler -> outputs."""
