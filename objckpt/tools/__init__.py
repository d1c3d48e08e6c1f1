"""Operations on committed checkpoints: inspect, verify, copy."""
