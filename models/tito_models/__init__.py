"""The models tito builds itself, offline and deterministically: the random-weight tiny models
(`tiny`), the trained demo model (`demo`), Qwen's real vocabulary (`real_vocab`), and what a
`--model` value names (`paths`)."""
