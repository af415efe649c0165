"""What more than one kind of Keel process must agree on, once: the etcd client and key
layout, the environment contract, the layout grammar, the deadline chain, TLS and
credentials, logging, and process-group helpers. Imports only ``protos`` and
third-party libraries; agent, orchestrator and trainer import it."""
