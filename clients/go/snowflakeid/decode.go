// Package snowflakeid decodes and composes snowflake ids, with the standard library only.
//
// An id is 0 | timestamp | datacenter | worker | sequence: by default (DefaultLayout,
// Twitter's) 41 bits of ms since 1288834974657, 5 + 5 bits of datacenter and worker
// ids, and 12 bits of sequence. Ids fit an int64; in JSON they travel as strings,
// which DecodeString takes.
//
//	parts, err := snowflakeid.DecodeString("910499571847892992", snowflakeid.DefaultLayout)
//	// parts.Time is 2017-09-20T13:43:08.849Z, DatacenterID 17, WorkerID 25, Sequence 0
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
type Layout struct {
	EpochMs          int64 `json:"epoch_ms"`
	TimestampBits    int   `json:"timestamp_bits"`
	DatacenterIDBits int   `json:"datacenter_id_bits"`
	WorkerIDBits     int   `json:"worker_id_bits"`
	SequenceBits     int   `json:"sequence_bits"`
}

// DefaultLayout is Twitter's, the server's default.
var DefaultLayout = Layout{
	EpochMs:          1288834974657,
	TimestampBits:    41,
	DatacenterIDBits: 5,
	WorkerIDBits:     5,
	SequenceBits:     12,
}

// Parts are what an id is made of. TimestampMs is ms since 1970; Time is the same
// instant in UTC.
type Parts struct {
	ID           int64
	TimestampMs  int64
	Time         time.Time
	DatacenterID int64
	WorkerID     int64
	Sequence     int64
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
		return fmt.Errorf("snowflakeid: the layout needs %d bits but an id has %d: %w",
			total, IDBits, ErrLayout)
	}
	if l.EpochMs < 0 {
		return fmt.Errorf("snowflakeid: epoch_ms must not be negative, got %d: %w",
			l.EpochMs, ErrLayout)
	}
	return nil
}

func (l Layout) workerShift() int     { return l.SequenceBits }
func (l Layout) datacenterShift() int { return l.SequenceBits + l.WorkerIDBits }
func (l Layout) timestampShift() int {
	return l.SequenceBits + l.WorkerIDBits + l.DatacenterIDBits
}

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
		ID:           id,
		TimestampMs:  ms,
		Time:         time.UnixMilli(ms).UTC(),
		DatacenterID: id >> layout.datacenterShift() & mask(layout.DatacenterIDBits),
		WorkerID:     id >> layout.workerShift() & mask(layout.WorkerIDBits),
		Sequence:     id & mask(layout.SequenceBits),
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

// Compose returns the id of these parts under layout: the inverse of Decode. A part
// that does not fit its field gives an error matching ErrRange.
func Compose(timestampMs, datacenterID, workerID, sequence int64, layout Layout) (int64, error) {
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
	}
	for _, f := range fields {
		if f.value < 0 || f.value > f.max {
			return 0, fmt.Errorf("snowflakeid: %s must be in 0..%d, got %d: %w", f.name, f.max, f.value, ErrRange)
		}
	}
	return (timestampMs-layout.EpochMs)<<layout.timestampShift() |
		datacenterID<<layout.datacenterShift() |
		workerID<<layout.workerShift() |
		sequence, nil
}
