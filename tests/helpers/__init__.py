"""What the test modules share, one module per concern (a test module never imports
another): ``agents`` (host pools, agent pairs on loopback, polling), ``engines`` (the real
engines the suite runs on), ``child`` (scripts in a fresh process)."""
