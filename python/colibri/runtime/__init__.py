"""What runs a generation once a request is understood: the engine wrapper, the generator that
drives it off the event loop, the scheduler of KV slots, admission, and the reply that streams
or collects the engine's events. Nothing here knows a protocol's shape; the API layer encodes."""
