"""The Keel controller: etcd state, reconcile loop, policies, gRPC servers and the CLI."""
