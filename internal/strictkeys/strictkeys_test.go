package strictkeys

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

type keysInner struct {
	A int `json:"a"`
	B int // named B, as encoding/json names it
}

type keysSelf struct {
	keysInner
	Skip   int                 `json:"-"`
	hidden int                 // left out, as encoding/json leaves it
	Next   *keysSelf           `json:"next,omitempty"`
	Tags   map[string]int      `json:"tags"`
	Raw    json.RawMessage     `json:"raw"`
	List   []keysInner         `json:"list"`
	Any    any                 `json:"any"`
	Over   int                 `json:"a_over"`
	Nested map[string]keysSelf `json:"nested"`
}

// TestCheckNamesFieldsAsEncodingJSON: Check takes a field's name
// as encoding/json writes it (tag, Go name, an embedded struct's lifted),
// any key once in a map, an interface or a type that decodes itself, and
// follows a type that holds itself.
func TestCheckNamesFieldsAsEncodingJSON(t *testing.T) {
	typ := reflect.TypeFor[keysSelf]()
	_ = keysSelf{}.hidden
	for _, ok := range []string{
		`{"a":1,"B":2,"next":{"next":{"a":3}},"tags":{"X":1,"x":2},"raw":{"a":1,"A":2},"list":[{"a":1},{"B":1}],"any":{"k":{"K":1}}}`,
		`{"nested":{"k":{"a":1},"K":{"B":2}}}`, `{}`, `{"next":null}`,
	} {
		if err := Check([]byte(ok), typ); err != nil {
			t.Errorf("%s: %v", ok, err)
		}
	}
	for _, c := range []struct{ body, want string }{
		{`{"A":1}`, `unknown field "A"`},
		{`{"b":1}`, `unknown field "b"`},
		{`{"Skip":1}`, `unknown field "Skip"`},
		{`{"hidden":1}`, `unknown field "hidden"`},
		{`{"next":{"next":{"A":1}}}`, `next.next: unknown field "A"`},
		{`{"tags":{"x":1,"x":2}}`, `tags: key "x" given twice`},
		{`{"raw":{"a":1,"a":2}}`, `raw: key "a" given twice`},
		{`{"list":[{"a":1},{"a":1,"a":2}]}`, `list[1]: field "a" given twice`},
		{`{"any":[{"k":[{"z":1,"z":1}]}]}`, `any[0].k[0]: key "z" given twice`},
		{`{"nested":{"k":{"next":{"Tags":{}}}}}`, `nested.k.next: unknown field "Tags"`},
		{`{"a":1,"a":1}`, `field "a" given twice`},
	} {
		if err := Check([]byte(c.body), typ); err == nil || err.Error() != c.want && !strings.HasPrefix(err.Error(), c.want+" (") {
			t.Errorf("%s: %v, want %s", c.body, err, c.want)
		}
	}
	for _, broken := range []string{`{"a"`, `{"a":1`, `{"a":1 x`, `[`, `"abc`, `{"a":[1,2`, ``} {
		if err := Check([]byte(broken), typ); err == nil {
			t.Errorf("%q: no error", broken)
		}
	}
}
