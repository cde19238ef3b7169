"""A TLS endpoint in front of plain Redis servers, as a managed Redis offers one (the project's
redis-server is built without TLS): ``python tests/tls_proxy.py CERT KEY PORT:TARGET_PORT ...``
accepts TLS on each PORT (127.0.0.1) and relays the decrypted bytes to TARGET_PORT; it prints
``ready`` once every port listens. ``certificates`` makes a CA and a server certificate for it."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import sys
from pathlib import Path


def certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA (``ca.pem``) and a certificate it signed for 127.0.0.1 / localhost (``server.pem``,
    ``server.key``), written under ``folder``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def issued(subject: str, key, issuer: x509.Name, signer, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "featurestore test CA")])
    ca = issued("featurestore test CA", ca_key, ca_name, ca_key, ca=True)
    server = issued("localhost", server_key, ca_name, ca_key, ca=False)
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return paths


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def _serve(cert: str, key: str, pairs: list[tuple[int, int]]) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    def handler(target: int):
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", target)
            except OSError:
                writer.close()
                return
            await asyncio.gather(_relay(reader, upstream_writer), _relay(upstream_reader, writer))

        return accepted

    servers = [await asyncio.start_server(handler(target), "127.0.0.1", port, ssl=context) for port, target in pairs]
    print("ready", flush=True)
    await asyncio.gather(*(server.serve_forever() for server in servers))


if __name__ == "__main__":
    cert, key, *specs = sys.argv[1:]
    asyncio.run(_serve(cert, key, [(int(a), int(b)) for a, b in (spec.split(":") for spec in specs)]))
