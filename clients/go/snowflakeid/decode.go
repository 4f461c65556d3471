// Package snowflakeid decodes and composes snowflake ids, with the standard library only.
//
// An id is 0 | timestamp | clock sequence | datacenter | worker | sequence: by default
// (DefaultLayout, Twitter's) 41 bits of ms since 1288834974657, no clock sequence, 5 + 5
// bits of datacenter and worker ids, and 12 bits of sequence. Ids fit an int64; in JSON
// they travel as strings, which DecodeString takes.
//
// A clock sequence has bits only when the server runs with --clock-sequence-bits: it is
// a value the server moves to when its clock steps back, so that its ids at times it
// already used stay unique. It sits below the timestamp, so ids still sort by time first.
//
//	parts, err := snowflakeid.DecodeString("910499571847892992", snowflakeid.DefaultLayout)
//	// parts.Time is 2017-09-20T13:43:08.849Z, DatacenterID 17, WorkerID 25, Sequence 0,
//	// ClockSequence 0
//
// Errors match ErrFormat (not a decimal integer), ErrRange (not an id of the layout)
// or ErrLayout (a layout no server could have) with errors.Is.
package snowflakeid

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"
)

// IDBits is how many bits an id may use: the sign bit stays 0.
const IDBits = 63

var (
	// ErrFormat: the text is not a decimal integer (an optional '-', then ASCII digits).
	ErrFormat = errors.New("not a decimal integer")
	// ErrRange: the integer is not an id of the layout (negative, or wider than it).
	ErrRange = errors.New("not an id of this layout")
	// ErrLayout: the layout's widths do not fit an id, or its epoch is negative.
	ErrLayout = errors.New("invalid layout")
)

// Layout says how ids are packed: an epoch in ms since 1970 and each field's width.
// Its JSON tags match the server's GET /v1/layout, so that answer unmarshals into it.
// ClockSequenceBits is 0 unless the server runs with --clock-sequence-bits; a server
// from before it leaves clock_sequence_bits out, which unmarshals as that same 0.
type Layout struct {
	EpochMs           int64 `json:"epoch_ms"`
	TimestampBits     int   `json:"timestamp_bits"`
	DatacenterIDBits  int   `json:"datacenter_id_bits"`
	WorkerIDBits      int   `json:"worker_id_bits"`
	SequenceBits      int   `json:"sequence_bits"`
	ClockSequenceBits int   `json:"clock_sequence_bits"`
}

// DefaultLayout is Twitter's, the server's default.
var DefaultLayout = Layout{
	EpochMs:           1288834974657,
	TimestampBits:     41,
	DatacenterIDBits:  5,
	WorkerIDBits:      5,
	SequenceBits:      12,
	ClockSequenceBits: 0,
}

// Parts are what an id is made of. TimestampMs is ms since 1970; Time is the same
// instant in UTC. ClockSequence is always 0 in a layout without one.
type Parts struct {
	ID            int64
	TimestampMs   int64
	Time          time.Time
	DatacenterID  int64
	WorkerID      int64
	Sequence      int64
	ClockSequence int64
}

// Validate returns an error matching ErrLayout unless every width is in range (the
// timestamp and the sequence at least 1 bit) and all of them fit in IDBits.
func (l Layout) Validate() error {
	fields := []struct {
		name      string
		bits, min int
	}{
		{"timestamp_bits", l.TimestampBits, 1},
		{"datacenter_id_bits", l.DatacenterIDBits, 0},
		{"worker_id_bits", l.WorkerIDBits, 0},
		{"sequence_bits", l.SequenceBits, 1},
		{"clock_sequence_bits", l.ClockSequenceBits, 0},
	}
	total := 0
	for _, f := range fields {
		if f.bits < f.min || f.bits > IDBits {
			return fmt.Errorf("snowflakeid: %s must be in %d..%d, got %d: %w",
				f.name, f.min, IDBits, f.bits, ErrLayout)
		}
		total += f.bits
	}
	if total > IDBits {
		// As the server says it: every width, and where a clock sequence's bits can come from.
		clock, hint := "", ""
		if l.ClockSequenceBits != 0 {
			clock = fmt.Sprintf(" + clock_sequence_bits %d", l.ClockSequenceBits)
			hint = "; take the clock sequence's bits from the node id " +
				"(fewer datacenter_id_bits or worker_id_bits)"
		}
		return fmt.Errorf("snowflakeid: the layout needs %d bits (timestamp_bits %d%s + "+
			"datacenter_id_bits %d + worker_id_bits %d + sequence_bits %d) but an id has %d%s: %w",
			total, l.TimestampBits, clock, l.DatacenterIDBits, l.WorkerIDBits, l.SequenceBits,
			IDBits, hint, ErrLayout)
	}
	if l.EpochMs < 0 {
		return fmt.Errorf("snowflakeid: epoch_ms must not be negative, got %d: %w",
			l.EpochMs, ErrLayout)
	}
	return nil
}

func (l Layout) workerShift() int     { return l.SequenceBits }
func (l Layout) datacenterShift() int { return l.SequenceBits + l.WorkerIDBits }
func (l Layout) clockSequenceShift() int {
	return l.SequenceBits + l.WorkerIDBits + l.DatacenterIDBits
}
func (l Layout) timestampShift() int { return l.clockSequenceShift() + l.ClockSequenceBits }

// MaxID is the largest id of the layout (assumed valid).
func (l Layout) MaxID() int64 {
	return int64(uint64(1)<<(l.timestampShift()+l.TimestampBits) - 1)
}

func mask(bits int) int64 { return int64(uint64(1)<<bits - 1) }

// Decode returns the parts of id under layout. An id that is negative or wider than
// the layout gives an error matching ErrRange; an invalid layout, ErrLayout.
func Decode(id int64, layout Layout) (Parts, error) {
	if err := layout.Validate(); err != nil {
		return Parts{}, err
	}
	if id < 0 || id > layout.MaxID() {
		return Parts{}, fmt.Errorf("snowflakeid: %d is not in 0..%d: %w", id, layout.MaxID(), ErrRange)
	}
	elapsed := id >> layout.timestampShift()
	// A late epoch and many timestamp bits could pass the largest int64.
	if elapsed > math.MaxInt64-layout.EpochMs {
		return Parts{}, fmt.Errorf("snowflakeid: the timestamp of %d passes 2^63 ms: %w", id, ErrRange)
	}
	ms := layout.EpochMs + elapsed
	return Parts{
		ID:            id,
		TimestampMs:   ms,
		Time:          time.UnixMilli(ms).UTC(),
		DatacenterID:  id >> layout.datacenterShift() & mask(layout.DatacenterIDBits),
		WorkerID:      id >> layout.workerShift() & mask(layout.WorkerIDBits),
		Sequence:      id & mask(layout.SequenceBits),
		ClockSequence: id >> layout.clockSequenceShift() & mask(layout.ClockSequenceBits),
	}, nil
}

// DecodeString decodes an id given as decimal text, as ids travel in JSON. Anything but
// an optional '-' followed by ASCII digits gives an error matching ErrFormat (strconv
// alone would also take "+1" and, with base 0, "0x1F" or "1_0"); an integer outside
// the layout, ErrRange.
func DecodeString(s string, layout Layout) (Parts, error) {
	digits := s
	if len(digits) > 0 && digits[0] == '-' {
		digits = digits[1:]
	}
	if digits == "" {
		return Parts{}, fmt.Errorf("snowflakeid: %q: %w", s, ErrFormat)
	}
	for i := 0; i < len(digits); i++ {
		if digits[i] < '0' || digits[i] > '9' {
			return Parts{}, fmt.Errorf("snowflakeid: %q: %w", s, ErrFormat)
		}
	}
	id, err := strconv.ParseInt(s, 10, 64)
	if err != nil { // only a value past int64 gets here
		return Parts{}, fmt.Errorf("snowflakeid: %s does not fit 63 bits: %w", s, ErrRange)
	}
	return Decode(id, layout)
}

// Compose returns the id of these parts under layout, with clock sequence 0: the inverse
// of Decode for an id whose ClockSequence is 0 (every id of a layout without one). A part
// that does not fit its field gives an error matching ErrRange.
func Compose(timestampMs, datacenterID, workerID, sequence int64, layout Layout) (int64, error) {
	return ComposeWithClockSequence(timestampMs, datacenterID, workerID, sequence, 0, layout)
}

// ComposeWithClockSequence is Compose with a clock sequence, which must fit the layout's
// ClockSequenceBits (only 0 fits a layout without one): the inverse of Decode for every
// id. (A function of its own, so that Compose's callers from before clock sequences
// still build.)
func ComposeWithClockSequence(
	timestampMs, datacenterID, workerID, sequence, clockSequence int64, layout Layout,
) (int64, error) {
	if err := layout.Validate(); err != nil {
		return 0, err
	}
	if timestampMs < layout.EpochMs || uint64(timestampMs-layout.EpochMs) > uint64(mask(layout.TimestampBits)) {
		return 0, fmt.Errorf("snowflakeid: timestamp %d ms is outside the layout's %d..%d: %w",
			timestampMs, layout.EpochMs, uint64(layout.EpochMs)+uint64(mask(layout.TimestampBits)), ErrRange)
	}
	fields := []struct {
		name       string
		value, max int64
	}{
		{"datacenter id", datacenterID, mask(layout.DatacenterIDBits)},
		{"worker id", workerID, mask(layout.WorkerIDBits)},
		{"sequence", sequence, mask(layout.SequenceBits)},
		{"clock sequence", clockSequence, mask(layout.ClockSequenceBits)},
	}
	for _, f := range fields {
		if f.value < 0 || f.value > f.max {
			return 0, fmt.Errorf("snowflakeid: %s must be in 0..%d, got %d: %w", f.name, f.max, f.value, ErrRange)
		}
	}
	return (timestampMs-layout.EpochMs)<<layout.timestampShift() |
		clockSequence<<layout.clockSequenceShift() |
		datacenterID<<layout.datacenterShift() |
		workerID<<layout.workerShift() |
		sequence, nil
}
