"""Text <-> token ids, through the server's /tokenize and /detokenize or a local tokenizer.json."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Protocol

from sluice.loadtest.errors import BenchError


class TokenCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class ServerCodec:
    """vLLM's /tokenize and /detokenize, which Sluice, vLLM and SGLang serve."""

    def __init__(self, base_url: str, model: str, headers: dict[str, str]) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = {"Content-Type": "application/json", **headers}

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.base_url + path, data=json.dumps(body).encode(), headers=self.headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise BenchError(
                f"{self.base_url}{path} answered HTTP {exc.code}; the random and prefix datasets need the "
                "server's /tokenize and /detokenize, or a tokenizer file given with --tokenizer"
            ) from exc
        except (urllib.error.URLError, OSError) as exc:
            raise BenchError(f"cannot reach {self.base_url}{path}: {exc}") from exc
        except ValueError as exc:
            raise BenchError(f"{self.base_url}{path} answered with invalid JSON: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        body = self._post("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
        return list(body["tokens"])

    def decode(self, ids: list[int]) -> str:
        return str(self._post("/detokenize", {"model": self.model, "tokens": ids})["prompt"])


class FileCodec:
    """A Hugging Face tokenizer.json, read with the `tokenizers` package."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for a missing or bad file
            raise BenchError(f"cannot read tokenizer file {path}: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))


def token_codec(base_url: str, model: str, headers: dict[str, str], tokenizer: Path | None) -> TokenCodec:
    return FileCodec(tokenizer) if tokenizer is not None else ServerCodec(base_url, model, headers)
