"""HTTPS end to end: `sluice serve --ssl-certfile --ssl-keyfile` with a self-signed certificate made
here (openssl), reached by the `openai` client that trusts that certificate and checks it; plain HTTP
on the same port gets no answer, and a certificate without its key is a startup error that names it.
"""

from __future__ import annotations

import http.client
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest

from serve_fixtures import SLUICE, Server, running_server

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sk-sluice-tls"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        + ["-days", "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"]
        + ["-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certificate: tuple[Path, Path]) -> Iterator[Server]:
    cert, key = certificate
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = [
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        "0.5",
        "--ssl-certfile",
        str(cert),
        "--ssl-keyfile",
        str(key),
    ]
    with running_server(args, log, api_key=API_KEY) as running:
        yield running


def test_the_openai_client_talks_https_and_checks_the_certificate(
    server: Server, certificate: tuple[Path, Path]
) -> None:
    trusted = ssl.create_default_context(cafile=str(certificate[0]))
    with openai.OpenAI(
        base_url=f"https://127.0.0.1:{server.port}/v1",
        api_key=API_KEY,
        max_retries=0,
        http_client=httpx2.Client(verify=trusted),
    ) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert reply.choices[0].message.content is not None
        assert client.models.list().data[0].id == MODEL
    # A client that does not trust the certificate refuses it.
    with pytest.raises(ssl.SSLCertVerificationError):
        connection = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=10)
        try:
            connection.request("GET", "/health")
        finally:
            connection.close()


def test_plain_http_on_the_https_port_gets_no_answer(server: Server) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError, http.client.BadStatusLine)):
            connection.request("GET", "/health")
            connection.getresponse()
    finally:
        connection.close()


def test_a_certificate_without_its_key_is_a_startup_error(certificate: tuple[Path, Path]) -> None:
    done = subprocess.run(
        [str(SLUICE), "serve", "--max-model-len", "512", "--ssl-certfile", str(certificate[0])],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "give both --ssl-certfile and --ssl-keyfile" in done.stderr, done.stderr[-2000:]
