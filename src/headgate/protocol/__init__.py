"""The sans-IO core of headgate: frames, codec, channels, handles, sessions.

Nothing in this package performs I/O or reads a clock. Bytes go in, events and
bytes come out; time, where a rule needs it, is an argument.
"""
