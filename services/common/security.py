"""Service-to-service security, the one home: flags, secret files, server TLS/token, client credentials.

Every `serve` command gets the same flags from `add_security_args` (clients such as `rlfabric train` get the
client subset): `--auth-token-file`, `--tls-cert`, `--tls-key`, `--tls-ca`, `--redis-url-file`. Secrets travel
in files only, never on a command line (where `ps` shows them) nor in environment variables: a launcher such as
`rlfabric up` writes them 0600 into the run directory and hands children the paths.

The flags hold paths; `resolve_secrets` (called by `server_security` and `configure_client`, which every command
calls first) reads them into `args.auth_token` and `args.redis_url` as `SecretFile`s (strs that remember their
flag and path and never print themselves), so a launcher that re-creates a command line from parsed flags
(`trainer serve` -> `trainer rank`) passes the paths on, not the secrets, and manifests validate without them.

The credentials themselves live in credentials.py, which `create_server` and `make_channel` read; this module
sets them from the flags. What each service requires the token on is `credentials.GUARDED_METHODS`.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from services.common.credentials import (
    GUARDED_METHODS,
    ClientCredentials,
    ServerCredentials,
    TlsConfig,
    set_client_credentials,
    set_server_credentials,
)
from services.common.net import env_redis_url

logger = logging.getLogger(__name__)


class SecretFileError(ValueError):
    """A secret file is missing, unreadable or empty."""


class SecretFile(str):
    """A secret read from a file; `.flag` and `.path` say where it came from (for passing the path on)."""

    flag: str
    path: str

    def __new__(cls, value: str, flag: str, path: str) -> SecretFile:
        obj = super().__new__(cls, value)
        obj.flag = flag
        obj.path = path
        return obj

    def __repr__(self) -> str:  # never print the secret itself in logs or tracebacks
        return f"SecretFile({self.flag} {self.path})"

    def __reduce__(self) -> tuple:
        # A trainer group's rank 0 hands the call's token to the other ranks (their pushes need it), pickled.
        return SecretFile, (str(self), self.flag, self.path)


def read_secret_file(path: str | os.PathLike, flag: str) -> SecretFile:
    """The stripped first line of `path`; SecretFileError naming `flag` and the file when unusable."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_text(encoding="utf-8").strip().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SecretFileError(f"{flag} {p}: cannot read it: {e}") from e
    if mode & stat.S_IROTH:  # a warning, not a refusal: some runtimes mount secrets 0444 inside a container
        logger.warning("%s %s: the file is readable by every user (mode %o); chmod o-r it (0600 or 0640)",
                       flag, p, stat.S_IMODE(mode))
    if not text or not text[0].strip():
        raise SecretFileError(f"{flag} {p}: the file is empty")
    return SecretFile(text[0].strip(), flag, str(p))


def write_secret_file(path: Path, value: str) -> Path:
    """Writes `value` to `path` created 0600 (never world-readable, not even for an instant)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(value + "\n")
    os.chmod(path, 0o600)
    return path


def private_dir(path: Path) -> Path:
    """`path` created (with its parents) and made 0700: a run's, its logs' and Redis' folders hold what only
    the run's user may read (registrations in Redis' append-only file, service logs)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def open_private_log(path: Path):
    """`path` opened for appending (binary), created 0600; an existing file is made 0600. A missing folder is
    created 0700; an existing one keeps its mode (a caller's folder is the caller's to protect)."""
    if not Path(path).parent.exists():
        private_dir(Path(path).parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


def add_security_args(parser: argparse.ArgumentParser, *, server: bool = True, token: bool = True,
                      tls: bool = True, redis: bool = True) -> None:
    """The security flags: token and Redis URL from files, TLS material.

    `server=False` gives a client's subset (no certificate of its own); `token`, `tls`, `redis` False leave
    out flags a command has no use for.
    """
    g = parser.add_argument_group("security")
    if token:
        what = ("required on the mutating RPCs this service serves and sent on every call it makes to other "
                "services" if server else "sent as 'authorization: Bearer TOKEN' on every call")
        g.add_argument("--auth-token-file", default=None, metavar="PATH", help=f"file holding the shared service token, {what} (not world-readable)")
    if server and token:
        g.add_argument("--insecure", action="store_true",
                       help="without --auth-token-file, serve the guarded RPCs to every caller (a test or a "
                            "network nobody else reaches); without either flag they refuse every caller")
    if server and tls:
        g.add_argument("--tls-cert", default=None, metavar="PEM",
                       help="serve TLS with this certificate chain (needs --tls-key)")
        g.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    if tls:
        g.add_argument("--tls-ca", default=None, metavar="PEM",
                       help="CA bundle that signs the services' certificates: calls to other services use TLS "
                            "verified against it")
    if redis:
        g.add_argument("--redis-url-file", default=None, metavar="PATH",
                       help="file holding the Redis URL (instead of --redis-url, for a URL with a password)")


def resolve_secrets(args: argparse.Namespace) -> argparse.Namespace:
    """Reads the secret files of the flags into `args.auth_token` and `args.redis_url` (idempotent).

    SecretFileError (a ValueError) names the flag and the file when one cannot be used.
    """
    if hasattr(args, "auth_token_file") and not isinstance(getattr(args, "auth_token", None), SecretFile):
        args.auth_token = read_secret_file(args.auth_token_file, "--auth-token-file") if args.auth_token_file else None
    if getattr(args, "redis_url_file", None) and not isinstance(getattr(args, "redis_url", None), SecretFile):
        # A command's --redis-url default ($REDIS_URL, when set) yields to --redis-url-file.
        if getattr(args, "redis_url", None) and args.redis_url != env_redis_url():
            raise ValueError("give --redis-url or --redis-url-file, not both")
        args.redis_url = read_secret_file(args.redis_url_file, "--redis-url-file")
    return args



@dataclass(frozen=True)
class ServerSecurity:
    """What a server needs: its token (None: nothing guarded) and its TLS material (None: plaintext).

    `mode`: "token" (the guarded RPCs need --auth-token-file's token), "insecure" (--insecure: open to every
    caller) or "closed" (neither flag: they refuse every caller, the server's token being one nobody knows).
    """

    token: str | None
    tls: TlsConfig | None
    mode: str = "token"


CLOSED_REFUSAL = ("this server was started without --auth-token-file, so its guarded RPCs refuse every caller; "
                  "restart it with --auth-token-file (and give its callers the same token) or with --insecure")


def server_security(args: argparse.Namespace, service: str | None = None) -> ServerSecurity:
    """ServerSecurity of the flags; ValueError naming a flag given without its partner or a missing file.

    Makes them this process's credentials (credentials.py): of every server it creates and of its calls to
    other services. Without a token the server fails closed unless `--insecure` says
    otherwise; with `service` (a GUARDED_METHODS key) the mode is logged, as the service's first log line.
    """
    resolve_secrets(args)
    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", getattr(args, "tls_ca", None))):
        if path and not Path(path).is_file():
            raise ValueError(f"{flag} {path}: no such file")
    configure_client(args)
    tls = TlsConfig(cert, key) if cert else None
    token = getattr(args, "auth_token", None) or None
    insecure = bool(getattr(args, "insecure", False))
    if token and insecure:
        raise ValueError("--insecure opens the guarded RPCs to every caller: give it or --auth-token-file, not both")
    mode = "token" if token else "insecure" if insecure else "closed"
    if mode == "closed":  # as if a token were set that no caller has; calls this process makes send none
        set_server_credentials(ServerCredentials(secrets.token_hex(32), tls, CLOSED_REFUSAL))
    else:
        set_server_credentials(ServerCredentials(token, tls))
    if service is not None:
        announce_auth(service, mode)
    return ServerSecurity(token, tls, mode)


def announce_auth(service: str, mode: str) -> None:
    """Logs who may call `service`'s guarded RPCs: INFO with a token, WARNING without one."""
    methods = ", ".join(sorted(GUARDED_METHODS[service]))
    if mode == "token":
        logger.info("auth: token; %s need --auth-token-file's token", methods)
    elif mode == "insecure":
        logger.warning("auth: INSECURE (--insecure, no --auth-token-file); %s are open to every caller", methods)
    else:
        logger.warning("auth: closed (no --auth-token-file); %s refuse every caller; give --auth-token-file, "
                       "or --insecure to open them", methods)


def configure_client(args: argparse.Namespace) -> None:
    """Makes the flags' token and CA what this process's calls to other services carry (`make_channel`)."""
    resolve_secrets(args)
    ca = getattr(args, "tls_ca", None)
    if ca and not Path(ca).is_file():
        raise ValueError(f"--tls-ca {ca}: no such file")
    set_client_credentials(ClientCredentials(getattr(args, "auth_token", None) or None, ca or None))


def child_args(*, token_file: Path | None, tls: tuple[Path, Path, Path] | None = None,
               redis_url_file: Path | None = None, server: bool = True) -> list[str]:
    """The command-line flags that hand a child the same security (paths only, never a secret)."""
    out: list[str] = []
    if token_file is not None:
        out += ["--auth-token-file", str(token_file)]
    if tls is not None:
        cert, key, ca = tls
        if server:
            out += ["--tls-cert", str(cert), "--tls-key", str(key)]
        out += ["--tls-ca", str(ca)]
    if redis_url_file is not None:
        out += ["--redis-url-file", str(redis_url_file)]
    return out


def redact_url(url: str) -> str:
    """`url` with any password replaced by ***, for logs and messages."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if not parts.password:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def generate_tls(out_dir: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
                 days: int = 30) -> tuple[Path, Path, Path]:
    """A private CA and one server certificate for `hosts`, written to `out_dir`: (cert, key, ca) paths.

    For one run on one host (`rlfabric up --tls`): every service serves the same certificate, and the CA's
    key is never written (nothing else is ever signed with it). Keys are files created 0600.
    """
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rlfabric run CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    out_dir.mkdir(parents=True, exist_ok=True)
    key_path = write_secret_file(out_dir / "tls.key", key_pem.strip())
    cert_path = out_dir / "tls.crt"
    cert_path.write_bytes(cert.public_bytes(pem))
    ca_path = out_dir / "ca.crt"
    ca_path.write_bytes(ca.public_bytes(pem))
    return cert_path, key_path, ca_path
