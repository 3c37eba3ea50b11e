"""End-to-end tests: each starts real processes (autofit commands, probe children, exported recipes,
torchrun ranks) and checks what they do, say and leave behind; the fault suite's rows are here."""
