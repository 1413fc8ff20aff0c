"""Draft-free proposers for speculative decoding: they guess a sequence's next tokens from its own tokens (suffix
decoding: and from earlier requests' outputs)."""
