"""Credentials kept out of what a program prints: hookscope's own rule, for code that quotes errors.

hookscope never shows a credential it was given (in a message, a repr, a stored command). A
program around it (the ``hookscope`` command line, a training script) prints errors of other
libraries too, which may quote what they were given: botocore quotes a bucket, and with it the
``KEY:SECRET@`` before it. The same rule applies there:

- :func:`secret_key`: whether an option's name says its value is a secret (``secret``,
  ``aws_secret_access_key``, ``--hf-token``, ``X-Amz-Signature``); other values are shown;
- :func:`secrets_of`: the secrets in a store's URL (its ``user:password@`` and secret query
  values), its storage options (values of secret keys, nested ones too) and a command line;
- :func:`scrub`: a text with each token holding one of them replaced by ``***``, and every URL in
  it shown with ``***@`` for its user information and ``***`` for its secret query values.

>>> import hookscope.redaction as redaction
>>> argv = ["-o", "s3://b/f.zarr", "--storage-option", "secret=Sup3rSecret", "--storage-option", "profile=local"]
>>> secrets = redaction.secrets_of(argv=argv)
>>> redaction.scrub("InvalidToken 'Sup3rSecret' for http://me:pw@minio:9000; a local path", secrets)
"InvalidToken '***' for http://***@minio:9000; a local path"
"""

from __future__ import annotations

from hookscope._shared.credentials import scrub, secret_key, secrets_of
from hookscope._shared.names import public_dir

__all__ = ["scrub", "secret_key", "secrets_of"]


def __dir__() -> list[str]:
    """``__all__`` and the dunders, not the imports: what tab completion offers."""
    return public_dir(__name__)
