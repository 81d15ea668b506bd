"""Keys, signatures and proofs. NodeId = the node's raw 32-byte Ed25519 public key.

Every signature and MAC is over ``domain || payload`` with a distinct domain string, so a signature made for
one purpose can never be presented for another.
"""

from __future__ import annotations

import hashlib
import hmac

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

NodeId = bytes  # 32 bytes
NODE_ID_LEN = 32
SIG_LEN = 64

D_TOKEN = b"mesh-llm token v1\0"
D_ADMIT = b"mesh-llm admit v1\0"
D_AUTH = b"mesh-llm auth v1\0"
D_PROOF = b"mesh-llm secret proof v1\0"
D_RECORD = b"mesh-llm record v1\0"
D_MESH_ID = b"mesh-llm mesh id v1\0"
D_REVOKE = b"mesh-llm revoke v1\0"
D_REKEY = b"mesh-llm rekey v1\0"
D_ADMIN = b"mesh-llm admin v1\0"
D_DIRECTIVE = b"mesh-llm serve or drop v1\0"


def new_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def node_id(key: Ed25519PrivateKey) -> NodeId:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_to_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def key_from_bytes(raw: bytes) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(raw)


def sign(key: Ed25519PrivateKey, domain: bytes, payload: bytes) -> bytes:
    return key.sign(domain + payload)


def verify(node: NodeId, domain: bytes, payload: bytes, sig: bytes) -> bool:
    if len(node) != NODE_ID_LEN or len(sig) != SIG_LEN:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(node).verify(sig, domain + payload)
    except (InvalidSignature, ValueError):
        return False
    return True


def mac(secret: bytes, domain: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, domain + payload, hashlib.sha256).digest()


def mac_ok(secret: bytes, domain: bytes, payload: bytes, tag: bytes) -> bool:
    return hmac.compare_digest(mac(secret, domain, payload), tag)


def mesh_id_for(founder: NodeId) -> bytes:
    """A mesh is named by its founder's key, so the root of every admission chain is self-evident."""
    return hashlib.sha256(D_MESH_ID + founder).digest()[:16]


def short(node: NodeId) -> str:
    """A short, stable name for logs: the first 8 hex digits of the NodeId."""
    return node[:4].hex()
