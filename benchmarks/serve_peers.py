"""The peers benchmarks/serve.py measures redline against, serving the same model (serve_models.py).

    python benchmarks/serve_peers.py litserve digits PORT     LitServe, batching on (max 32 samples, 5 ms)
    python benchmarks/serve_peers.py fastapi digits PORT      a plain FastAPI endpoint, as its tutorial writes it

Both take the body redline takes (``{"inputs": [sample, ...]}``) and answer ``{"outputs": [...]}``.
They run in the benchmark's own environment (.venv-peers: see peers-requirements.txt).
"""

from __future__ import annotations

import sys

import torch

from serve_models import MODELS

MAX_BATCH, WAIT_S = 32, 0.005

try:  # at module level: LitServe's workers are spawned processes that find the class by name
    import litserve as ls
except ImportError:  # only the FastAPI server is wanted
    ls = None

if ls is not None:

    class LitModel(ls.LitAPI):
        """The model behind LitServe: requests decoded to tensors, batched, run, and split again."""

        model_name = "digits"

        def setup(self, device):
            self.model = MODELS[self.model_name]()

        def decode_request(self, request):
            return torch.tensor(request["inputs"], dtype=torch.float32)

        def batch(self, inputs):
            return torch.cat(inputs)

        @torch.inference_mode()
        def predict(self, x):
            return self.model(x)

        def unbatch(self, output):
            return list(output)

        def encode_response(self, output):
            return {"outputs": [output.tolist()]}


def litserve(name: str, port: int) -> None:
    import litserve as ls

    api = LitModel(max_batch_size=MAX_BATCH, batch_timeout=WAIT_S)
    api.model_name = name
    server = ls.LitServer(api, accelerator="cpu", devices=1)
    server.run(host="127.0.0.1", port=port, log_level="warning", generate_client_file=False)


def fastapi(name: str, port: int) -> None:
    import uvicorn
    from fastapi import FastAPI

    model = MODELS[name]()
    app = FastAPI()

    @app.post("/predict")
    def predict(request: dict) -> dict:
        with torch.inference_mode():
            return {"outputs": model(torch.tensor(request["inputs"], dtype=torch.float32)).tolist()}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    server, model_name, port_text = sys.argv[1:4]
    {"litserve": litserve, "fastapi": fastapi}[server](model_name, int(port_text))
