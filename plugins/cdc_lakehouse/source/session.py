"""source.session: split out of source.py."""

from __future__ import annotations

# Text output the capture, the bootstrap and the audit parse: fixed here, never left to the role's
# or the server's defaults. client_encoding matters for the SQL sessions; pgoutput sends text in
# the database encoding, which preflight requires to be UTF8.
SESSION_OPTIONS = (
    "-c DateStyle=ISO -c TimeZone=UTC -c IntervalStyle=iso_8601 -c extra_float_digits=3 "
    "-c bytea_output=hex -c client_encoding=UTF8"
)
