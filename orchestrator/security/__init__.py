"""Who may call the controller: role tokens, the certificates of ``keel certs init``,
and the controller's and the CLI's TLS settings."""
