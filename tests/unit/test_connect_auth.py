"""runtime.connect_auth's pure parts: the client URL, the token file's checks, the listener table
(/proc/net/tcp as the kernel writes it). The server itself, and another local user facing it:
tests/integration/test_connect_isolation.py."""

from __future__ import annotations

import os
import socket

import pytest
from cdc_lakehouse.runtime.connect_auth import (
    OWNER_ENV,
    TOKEN_FILE_ENV,
    ServerIdentityError,
    TokenFileError,
    check_listener,
    client_url,
    listener_owners,
    new_token,
    read_token,
)

# Two listeners on port 15002 (0x3A9A): 127.0.0.1 by uid 1000, and :: by uid 0; one connection
# (state 01) on the same port by uid 65534, which does not listen.
TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:3A9A 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 1 1
   1: 0100007F:3A9A 0100007F:D431 01 00000000:00000000 00:00000000 00000000 65534        0 2 1
   2: 0200000A:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000    33        0 3 1
"""
TCP6 = """  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:3A9A 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4 1
"""


def test_listener_owners_reads_the_kernels_table(tmp_path):
    (tmp_path / "tcp").write_text(TCP)
    (tmp_path / "tcp6").write_text(TCP6)
    assert listener_owners(15002, tmp_path) == {1000, 0}
    assert listener_owners(8080, tmp_path) == set()  # 10.0.0.2:8080 is not reachable on loopback
    assert listener_owners(15003, tmp_path / "none") == set()


def test_a_real_listener_of_this_user_is_ours_and_others_are_refused(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert listener_owners(port) == {os.geteuid()}
        check_listener("127.0.0.1", port)
        monkeypatch.setenv(OWNER_ENV, str(os.geteuid() + 1))
        with pytest.raises(ServerIdentityError, match=f"{port}.*{OWNER_ENV}"):
            check_listener("localhost", port)
        check_listener("spark.example.com", port)  # another host: TLS's job, not this check


def test_the_client_url_carries_the_token_and_names_loopback_localhost(monkeypatch, tmp_path):
    token_file = tmp_path / "token"
    token = new_token(token_file)
    assert token_file.stat().st_mode & 0o777 == 0o600 and read_token(token_file) == token
    assert new_token(token_file) != token  # a new one each start
    token = read_token(token_file)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    assert client_url("sc://127.0.0.1:1") == "sc://127.0.0.1:1"  # nothing to add: as given
    monkeypatch.setenv(TOKEN_FILE_ENV, str(token_file))
    assert client_url("sc://127.0.0.1:1") == f"sc://localhost:1/;token={token}"
    assert client_url("sc://[::1]:1/;user_id=a") == f"sc://localhost:1/;user_id=a;token={token}"
    # A token of its own (an Airflow connection's password) is kept; TLS keeps the host's name.
    assert client_url("sc://127.0.0.1:1/;token=own") == "sc://localhost:1/;token=own"
    assert client_url("sc://127.0.0.1:1/;token=own;use_ssl=true") == "sc://127.0.0.1:1/;token=own;use_ssl=true"
    # The local server's token never goes to another host.
    assert client_url("sc://spark.example.com:443/;use_ssl=true") == "sc://spark.example.com:443/;use_ssl=true"


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_token_file_others_could_read_is_refused(tmp_path, mode):
    path = tmp_path / "token"
    new_token(path)
    path.chmod(mode)
    with pytest.raises(TokenFileError, match="chmod 600"):
        read_token(path)
    with pytest.raises(TokenFileError, match="no such file"):
        read_token(tmp_path / "missing")
