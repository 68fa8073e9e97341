"""Access: API keys (HTTP and gRPC), TLS between services, a Redis with a password, no pickle.

The certificates are made here (a throwaway CA and a leaf for 127.0.0.1 signed by it); the Redis
is a real redis-server started with `requirepass`; the stack is the launcher's, as
`specd serve api_server --api-keys ... --tls-...` starts it.
"""

from __future__ import annotations

import ast
import datetime
import ipaddress
import ssl
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.api_keys import ApiKeys, keys_from_env, parse_keys
from services.common.tls import TLSConfig, channel_credentials, open_channel
from specd import settings
from specd.transport.embedded_redis import redis_server_binary
from specd.transport.ports import free_port
from specd.v1 import generate_pb2, generate_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-specd-test-1"


# ---- certificates -----------------------------------------------------------------------------------
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key, cert: x509.Certificate) -> tuple[str, str]:
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".pem")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


def make_ca(path: Path, cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, _ = _write(path, key, cert)
    return key, cert, cert_file


def make_leaf(path: Path, ca_key, ca_cert, cn: str) -> tuple[str, str]:
    """A certificate for 127.0.0.1 / localhost, good for serving and as a client certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return _write(path, key, cert)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The stack's CA and leaf, and a second CA that trusts nothing of ours."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert, ca_file = make_ca(d / "ca", "specd test CA")
    cert_file, key_file = make_leaf(d / "service", ca_key, ca_cert, "specd service")
    _, _, other_ca_file = make_ca(d / "other-ca", "someone else's CA")
    return {"ca": ca_file, "cert": cert_file, "key": key_file, "other_ca": other_ca_file}


# ---- API keys, the pure part -----------------------------------------------------------------------------
def test_api_keys_accept_only_listed_bearer_keys(monkeypatch):
    keys = ApiKeys(["k1", "k2,k3"])  # lmdeploy also takes one comma-separated string
    assert keys.enabled and keys.keys == (b"k1", b"k2", b"k3")
    assert keys.is_valid_authorization("Bearer k2") and keys.is_valid_authorization("bearer  k3 ")
    for header in (None, "", "Bearer", "Bearer k", "Bearer k1x", "Basic k1", "k1", "Bearer \udcff"):
        assert not keys.is_valid_authorization(header), header
    assert ApiKeys([]).is_valid(None)  # no keys configured: open
    assert parse_keys(" a, ,b ") == ["a", "b"] and parse_keys(None) == []
    monkeypatch.setenv(settings.API_KEYS.name, "e1,e2")
    assert keys_from_env() == ["e1", "e2"]


def test_launcher_command_line_carries_keys_and_tls(monkeypatch, pki, tiny_models):
    """`specd serve api_server --api-keys A B --tls-...` reaches the StackConfig the supervisor runs."""
    import services.launcher.supervisor as supervisor
    from specd.cli import build_parser

    seen = {}
    monkeypatch.setattr(supervisor, "run_stack", lambda config: seen.setdefault("config", config) and 0)
    args = build_parser().parse_args(
        ["serve", "api_server", str(tiny_models["target-llama"]), "--api-keys", "A", "B", "--tls-cert-file",
         pki["cert"], "--tls-key-file", pki["key"], "--tls-ca-file", pki["ca"], "--request-timeout", "7", "--ssl"])
    assert args.func(args) == 0
    config = seen["config"]
    assert config.api_keys == ("A", "B") and config.request_timeout == 7.0 and config.ssl
    assert config.tls == TLSConfig(cert_file=pki["cert"], key_file=pki["key"], ca_file=pki["ca"])
    with pytest.raises(ValueError, match="tls"):  # serving TLS that the stack's own clients cannot verify
        supervisor.StackConfig(model="m", tls=TLSConfig(cert_file=pki["cert"], key_file=pki["key"]))
    with pytest.raises(ValueError, match="ssl"):  # HTTPS without a certificate
        supervisor.StackConfig(model="m", ssl=True)


# ---- TLS between services ------------------------------------------------------------------------------
def _health(address: str, tls: TLSConfig, timeout: float = 3.0) -> int:
    with open_channel(address, tls) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status


def test_tls_drafter_and_grammar_refuse_what_they_cannot_verify(tiny_models, pki):
    from services.drafter.server import load_drafter
    from services.drafter.server import start_server as start_drafter
    from services.grammar.server import load_grammar
    from services.grammar.server import start_server as start_grammar
    from specd.grammar.backend import GrammarSpec
    from specd.clients.errors import DrafterError, GrammarServiceError
    from specd.clients.grammar import RemoteGrammarBackend
    from specd.messages import SpeculativeConfig
    from specd.clients.drafter import RemoteProposer

    model = tiny_models["target-llama"]
    server_tls = TLSConfig(cert_file=pki["cert"], key_file=pki["key"])
    client_tls = TLSConfig(ca_file=pki["ca"])
    drafter = start_drafter(load_drafter(model, SpeculativeConfig(method="ngram", num_speculative_tokens=3)),
                            "127.0.0.1", 0, max_workers=4, tls=server_tls)
    # The grammar service also demands a client certificate from our CA (mutual TLS).
    grammar = start_grammar(load_grammar(model), "127.0.0.1", 0, max_workers=4,
                            tls=TLSConfig(cert_file=pki["cert"], key_file=pki["key"], client_ca_file=pki["ca"]))
    try:
        assert _health(drafter.address, client_tls) == health_pb2.HealthCheckResponse.SERVING
        # The probe containers run: `specd healthcheck grpc` takes the same TLS flags.
        from specd.cli import main as specd_main

        assert specd_main(["healthcheck", "grpc", drafter.address, "--tls-ca-file", pki["ca"]]) == 0
        assert specd_main(["healthcheck", "grpc", drafter.address, "--timeout", "1"]) == 1  # plaintext
        proposer = RemoteProposer([drafter.address], connect_timeout_s=5,
                                  credentials=channel_credentials(client_tls))
        assert proposer.method == "ngram"  # Info came back over TLS
        proposer.shutdown()
        for wrong in (None, channel_credentials(TLSConfig(ca_file=pki["other_ca"]))):  # plaintext; foreign CA
            with pytest.raises(DrafterError):
                RemoteProposer([drafter.address], connect_timeout_s=1, credentials=wrong)

        spec = GrammarSpec(kind="json_object")
        mutual = TLSConfig(cert_file=pki["cert"], key_file=pki["key"], ca_file=pki["ca"])
        with RemoteGrammarBackend(grammar.address, credentials=channel_credentials(mutual), deadline_s=5) as ok:
            ok.validate(spec)  # raises unless the service answered
        for tls in (client_tls, TLSConfig(ca_file=pki["other_ca"])):  # no client certificate; foreign CA
            with RemoteGrammarBackend(grammar.address, credentials=channel_credentials(tls), deadline_s=1) as bad:
                with pytest.raises(GrammarServiceError):
                    bad.validate(spec)
        with pytest.raises(grpc.RpcError) as info:
            _health(grammar.address, TLSConfig(), timeout=1)  # plaintext against TLS
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        drafter.stop(0)
        grammar.stop(0)


def test_tls_config_refuses_half_settings(tmp_path):
    with pytest.raises(ValueError, match="both"):
        TLSConfig(cert_file="a.pem")
    with pytest.raises(ValueError, match="client certificates"):
        TLSConfig(client_ca_file="ca.pem")
    with pytest.raises(ValueError, match="cannot read"):
        channel_credentials(TLSConfig(ca_file=str(tmp_path / "missing.pem")))


# ---- the whole stack: keys, TLS, a password-protected Redis --------------------------------------------
@pytest.fixture(scope="module")
def redis_with_password():
    password = "p@ss w/ord"  # characters that need URL quoting
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="specd-redis-auth-")
    proc = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir, "--requirepass", password],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from urllib.parse import quote

    url = f"redis://:{quote(password, safe='')}@127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
            time.sleep(0.05)
    yield url, port
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def secured_stack(tiny_models, pki, redis_with_password):
    from services.launcher.supervisor import Stack, StackConfig

    url, _ = redis_with_password
    config = StackConfig(model=str(tiny_models["target-llama"]), server_name="127.0.0.1", server_port=free_port(),
                         grpc_port=free_port(), drafter_port=free_port(), redis_url=url,
                         speculative_algorithm="ngram", speculative_num_draft_tokens=3, max_batch_size=8,
                         enable_metrics=True, api_keys=(KEY, "sk-second"), request_timeout=60, ssl=True,
                         tls=TLSConfig(cert_file=pki["cert"], key_file=pki["key"], ca_file=pki["ca"]))
    stack = Stack(config)
    try:
        stack.start(timeout=240)
        yield stack
    finally:
        stack.stop()


def test_http_needs_a_key_but_health_and_metrics_do_not(secured_stack, pki):
    """Over HTTPS (--ssl, the services' certificate), every service and the verifier's admin port on
    TLS (the stack only starts once each answered its health check through it)."""
    base = f"https://127.0.0.1:{secured_stack.config.server_port}"
    http = httpx.Client(verify=ssl.create_default_context(cafile=pki["ca"]))
    for key in ("wrong-key", ""):
        client = openai.OpenAI(base_url=base + "/v1", api_key=key or "none", max_retries=0, timeout=30,
                               http_client=http)
        with pytest.raises(openai.AuthenticationError) as info:
            client.completions.create(model="x", prompt="hi", max_tokens=2)
        assert info.value.body["code"] == "invalid_api_key" and "valid api key" in info.value.body["message"]
    r = http.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    assert http.get(base + "/v1/models").status_code == 401
    assert http.get(base + "/health").status_code == 200
    assert "specd:" in http.get(base + "/metrics").text
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the HTTPS port
        httpx.get(f"http://127.0.0.1:{secured_stack.config.server_port}/health", timeout=3)

    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60, http_client=http)
    model = client.models.list().data[0].id
    plain = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=12, temperature=0)
    assert plain.usage.completion_tokens >= 1
    assert plain.model_extra["spec_stats"]["num_drafts"] >= 1  # the verifier reached the drafter over TLS
    # json_object: the gateway validated it and the verifier constrained it, both through the grammar
    # service over TLS.
    constrained = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "json"}],
                                                 max_tokens=24, temperature=0,
                                                 response_format={"type": "json_object"})
    assert constrained.choices[0].finish_reason in ("stop", "length")


def test_grpc_needs_key_metadata_and_tls(secured_stack, pki):
    address = f"127.0.0.1:{secured_stack.grpc_port}"
    tls = TLSConfig(ca_file=pki["ca"])
    request = generate_pb2.GenerateRequest(text="import os", max_tokens=6)
    with open_channel(address, tls) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        for metadata in ((), (("authorization", "Bearer nope"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Generate(request, metadata=metadata, timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                list(stub.GenerateStream(request, metadata=metadata, timeout=30))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:  # a garbled body without a key: still UNAUTHENTICATED
            channel.unary_unary("/specd.v1.Generate/Generate")(b"\xff\xff", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=60)
        assert reply.usage.completion_tokens >= 1
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert status.status == health_pb2.HealthCheckResponse.SERVING  # health needs no key
    with pytest.raises(grpc.RpcError):  # the gateway's gRPC API is TLS only
        _health(address, TLSConfig(), timeout=2)


def test_redis_password_is_required_and_used(secured_stack, redis_with_password):
    url, port = redis_with_password
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=port).xlen("specd:requests")
    # Both the gateway (XADD) and the verifier (XREADGROUP, XACK + XDEL) went through the password:
    # the requests above were answered and their entries removed.
    assert redis.Redis.from_url(url).xlen("specd:requests") == 0


# ---- nothing from the wire is unpickled ------------------------------------------------------------------
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib", "jsonpickle"}


def _unsafe_calls(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(node.module)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            keywords = {k.arg: k.value for k in node.keywords}
            base = ast.unparse(node.func.value)
            if node.func.attr == "load" and base == "torch":  # unpickles unless weights_only=True
                if not (isinstance(keywords.get("weights_only"), ast.Constant) and keywords["weights_only"].value):
                    found.append("torch.load without weights_only=True")
            if node.func.attr in ("load", "loads") and base in ("np", "numpy"):
                allow = keywords.get("allow_pickle")
                if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                    found.append("numpy load with allow_pickle")
            if node.func.attr == "load" and base == "yaml" and "Loader" not in keywords:
                found.append("yaml.load without a safe Loader")
    return found


def test_nothing_is_unpickled():
    """Every byte from a socket or Redis is JSON, protobuf or raw tensor bytes: no pickle anywhere."""
    files = sorted((REPO / "specd").rglob("*.py")) + sorted((REPO / "services").rglob("*.py"))
    assert len(files) > 50
    offenders = {str(f.relative_to(REPO)): bad for f in files
                 if (bad := _unsafe_calls(ast.parse(f.read_text(encoding="utf-8"))))}
    assert offenders == {}
    # The guard itself sees what it guards against.
    assert _unsafe_calls(ast.parse("import pickle\nfrom dill import loads\ntorch.load(f)\n"
                                   "np.load(f, allow_pickle=True)\ntorch.load(f, weights_only=True)")) == [
        "pickle", "dill", "torch.load without weights_only=True", "numpy load with allow_pickle"]


def test_two_grpc_services_cannot_share_a_port(tiny_models):
    """gRPC's default SO_REUSEPORT let a second server bind a taken port and answer half the calls."""
    from services.grammar.server import load_grammar
    from services.grammar.server import start_server as start_grammar

    servicer = load_grammar(tiny_models["target-llama"])
    first = start_grammar(servicer, "127.0.0.1", 0, max_workers=2)
    try:
        port = int(first.address.rsplit(":", 1)[1])
        with pytest.raises(Exception, match="bind|port"):
            start_grammar(servicer, "127.0.0.1", port, max_workers=2).stop(0)
    finally:
        first.stop(0)


def test_free_ports_are_never_handed_out_twice():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


# ---- HTTPS on the OpenAI port; TLS on the verifier's admin port -------------------------------------
def test_https_serves_the_openai_port_with_the_service_certificate(tiny_models, pki, redis_url):
    from services.gateway.core import GatewayConfig
    from specd.messages import ConfigError
    from tests.services.gateway_harness import ServiceLoop

    tls = TLSConfig(cert_file=pki["cert"], key_file=pki["key"])
    with pytest.raises(ConfigError, match="ssl"):
        GatewayConfig(model=str(tiny_models["target-llama"]), ssl=True)
    services = ServiceLoop()
    try:
        server = services.start(GatewayConfig(model=str(tiny_models["target-llama"]), redis_url=redis_url,
                                              tls=tls, ssl=True))
        url, ours = f"https://127.0.0.1:{server.port}", ssl.create_default_context(cafile=pki["ca"])
        assert httpx.get(f"{url}/health", verify=ours).status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, http_client=httpx.Client(verify=ours))
        assert client.models.list().data[0].id == str(tiny_models["target-llama"])
        for bad in (dict(verify=ssl.create_default_context(cafile=pki["other_ca"])), dict(verify=True)):
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{url}/health", **bad)
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the HTTPS port
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=3)
    finally:
        services.close()


def test_the_verifier_admin_port_serves_tls(pki):
    from services.common.tls import server_credentials
    from services.verifier.admin import AdminServer

    admin = AdminServer("127.0.0.1", 0, credentials=server_credentials(
        TLSConfig(cert_file=pki["cert"], key_file=pki["key"], client_ca_file=pki["ca"]))).start()
    try:
        admin.set_serving(True)
        mutual = TLSConfig(cert_file=pki["cert"], key_file=pki["key"], ca_file=pki["ca"])
        assert _health(f"127.0.0.1:{admin.port}", mutual) == health_pb2.HealthCheckResponse.SERVING
        for wrong in (TLSConfig(), TLSConfig(ca_file=pki["ca"])):  # plaintext; no client certificate
            with pytest.raises(grpc.RpcError):
                _health(f"127.0.0.1:{admin.port}", wrong, timeout=1)
    finally:
        admin.server.stop(0)
