"""A Python client of `serve.py` (standard library only).

from flaxformer_lite.serving.client import Client
client = Client("http://127.0.0.1:8080")
client.translate(["en 4721"], beam_size=4, nbest=2)  # one dict per line
for event in client.stream("en 4721"):                # greedy, piece by piece
    print(event)
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator


class ServerError(Exception):
    """A non-200 answer: `status`, the server's one-line message, and Retry-After if any."""

    def __init__(self, status: int, message: str, retry_after: float | None = None):
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.retry_after = status, message, retry_after


class Client:
    def __init__(self, url: str = "http://127.0.0.1:8080", timeout: float = 120.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def translate(self, lines: list[str], **fields) -> list[dict]:
        """Per line {"hypotheses": [{"text", "score"}, ...]} or {"error": "..."}.

        Raises:
          ServerError: the request as a whole was refused (400, 413, 503, 504, ...).
        """
        with self._post({"text": list(lines), **fields}) as answer:
            return json.loads(answer.read())["translations"]

    def stream(self, line: str, **fields) -> Iterator[dict]:
        """Server-sent events of a greedy translation: {"line", "text"} per new piece, then
        {"line", "done": true, "text", "score"}."""
        body = {"text": [line], "beam_size": 1, **fields, "stream": True}
        with self._post(body) as answer:
            name = None
            for raw in answer:
                text = raw.decode("utf-8").rstrip("\n")
                if text.startswith("event: "):
                    name = text[7:]
                elif text.startswith("data: "):
                    if name == "end":
                        return
                    data = json.loads(text[6:])
                    if name == "error":
                        raise ServerError(504, data["error"])
                    yield data
                    name = None

    def health(self) -> dict:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=self.timeout) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as e:
            raise _server_error(e) from None

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=self.timeout) as answer:
            return answer.read().decode("utf-8")

    def _post(self, body: dict):
        data = json.dumps(body).encode("utf-8")
        request = urllib.request.Request(
            self.url + "/translate", data, {"Content-Type": "application/json"}
        )
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise _server_error(e) from None


def _server_error(e: urllib.error.HTTPError) -> ServerError:
    try:
        message = json.loads(e.read()).get("error", e.reason)
    except (ValueError, AttributeError):
        message = str(e.reason)
    retry = e.headers.get("Retry-After") if e.headers else None
    return ServerError(e.code, message, float(retry) if retry else None)
