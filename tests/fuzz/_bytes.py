"""A tiny decoder of fuzzer bytes into small integers (no atheris needed, so the corpus
replays under plain pytest). Reading past the end yields zeros, so every input is valid."""


class ByteReader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def remaining(self) -> int:
        return len(self.data) - self.pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        b = self.data[self.pos]
        self.pos += 1
        return b

    def below(self, n: int) -> int:
        """An int in [0, n) (n <= 65536)."""
        if n <= 1:
            return 0
        value = self.byte() if n <= 256 else self.byte() | (self.byte() << 8)
        return value % n

    def flag(self) -> bool:
        return bool(self.byte() & 1)

    def tokens(self, max_len: int, alphabet: int) -> list:
        return [self.below(alphabet) for _ in range(self.below(max_len + 1))]
