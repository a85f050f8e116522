//! Sequence tracking: what a publisher's batch sequence number says about lost events.

/// What one received sequence number means, given the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqCheck {
    /// The first batch seen, or the one expected next.
    InOrder,
    /// Batches `expected..got` were not received.
    Gap { expected: u64, got: u64 },
    /// The sequence went backwards: the publisher restarted.
    Backwards { expected: u64, got: u64 },
}

/// Tracks the next expected sequence number of one publisher.
#[derive(Debug, Clone, Default)]
pub struct SeqTracker {
    expected: Option<u64>,
}

impl SeqTracker {
    /// The next sequence number expected, if any batch was seen.
    pub fn expected(&self) -> Option<u64> {
        self.expected
    }

    /// Records that every batch up to `seq` is accounted for.
    pub fn advance_to(&mut self, seq: u64) {
        self.expected = Some(seq.wrapping_add(1));
    }

    /// Classifies `seq` and records it as received.
    pub fn check(&mut self, seq: u64) -> SeqCheck {
        let check = match self.expected {
            None => SeqCheck::InOrder,
            Some(expected) if seq == expected => SeqCheck::InOrder,
            Some(expected) if seq > expected => SeqCheck::Gap { expected, got: seq },
            Some(expected) => SeqCheck::Backwards { expected, got: seq },
        };
        self.advance_to(seq);
        check
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(seqs: &[u64], expect: &[SeqCheck]) {
        let mut tracker = SeqTracker::default();
        let got: Vec<SeqCheck> = seqs.iter().map(|&s| tracker.check(s)).collect();
        assert_eq!(got, expect, "sequence {seqs:?}");
    }

    #[test]
    fn accepts_a_contiguous_stream_from_any_start() {
        check(&[5, 6, 7], &[SeqCheck::InOrder; 3]);
    }

    #[test]
    fn reports_a_gap_with_its_bounds() {
        check(
            &[0, 1, 4, 5],
            &[
                SeqCheck::InOrder,
                SeqCheck::InOrder,
                SeqCheck::Gap {
                    expected: 2,
                    got: 4,
                },
                SeqCheck::InOrder,
            ],
        );
    }

    #[test]
    fn reports_a_restart_when_the_sequence_goes_backwards() {
        check(
            &[7, 8, 0, 1],
            &[
                SeqCheck::InOrder,
                SeqCheck::InOrder,
                SeqCheck::Backwards {
                    expected: 9,
                    got: 0,
                },
                SeqCheck::InOrder,
            ],
        );
    }

    #[test]
    fn a_repeated_sequence_number_is_a_restart() {
        check(
            &[3, 3],
            &[
                SeqCheck::InOrder,
                SeqCheck::Backwards {
                    expected: 4,
                    got: 3,
                },
            ],
        );
    }
}
