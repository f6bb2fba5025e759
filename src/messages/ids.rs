//! The shapes of ids, names and accounts: checked before an id is used in
//! a Redis key or a ledger entry.

use super::{Invalid, MAX_ENTRY_ID_LEN, MAX_ID_LEN};

/// Checks an id field: non-empty, at most [`MAX_ID_LEN`] bytes, printable
/// ASCII without `{` or `}`. Ids are data, never Redis key syntax: every id
/// of the wire contract and of the loaded configs passes here before it is
/// used in a key, so no id can name another pool's keys or break a Redis
/// Cluster hash tag (`pp:{<pool>}:…`).
pub fn check_id(field: &str, id: &str) -> Result<(), Invalid> {
    check_id_within(field, id, MAX_ID_LEN)
}

fn check_id_within(field: &str, id: &str, max_len: usize) -> Result<(), Invalid> {
    if id.is_empty() {
        return Err(Invalid::new(format!("`{field}` must not be empty")));
    }
    if id.len() > max_len {
        return Err(Invalid::new(format!(
            "`{field}` is longer than {max_len} bytes"
        )));
    }
    if let Some(c) = id.chars().find(|c| !valid_id_char(*c)) {
        return Err(Invalid::new(format!(
            "`{field}` must be printable ASCII without spaces, `{{` or `}}`; found {c:?}"
        )));
    }
    Ok(())
}

/// Checks the name of a pool or lottery activity, chosen by the operator
/// at load: an id ([`check_id`]) of ASCII letters, digits, `-`, `_` and `.`
/// only. A name never holds `:`, so ledger entry ids that start with one
/// (`draw:<pool>:…`, see [`crate::kinds::answer::entry_id`]) cannot collide.
pub fn check_name(field: &str, name: &str) -> Result<(), Invalid> {
    check_id(field, name)?;
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(Invalid::new(format!(
            "`{field}` may hold ASCII letters, digits, `-`, `_` and `.` only; found {c:?}"
        )));
    }
    Ok(())
}

/// Checks a ledger `entry_id`: like [`check_id`], up to
/// [`MAX_ENTRY_ID_LEN`] bytes, room for the fleet's own ids, which hold a
/// pool and a request id of [`MAX_ID_LEN`] each.
pub fn check_entry_id(id: &str) -> Result<(), Invalid> {
    check_id_within("entry_id", id, MAX_ENTRY_ID_LEN)
}

/// Whether `c` may appear in an id.
pub fn valid_id_char(c: char) -> bool {
    c.is_ascii_graphic() && c != '{' && c != '}'
}

/// Checks an account or user id: non-negative.
pub fn check_account(field: &str, account: i64) -> Result<(), Invalid> {
    if account < 0 {
        return Err(Invalid::new(format!("`{field}` must not be negative")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_have_no_key_or_entry_id_syntax() {
        assert!(check_name("id", "gift-2026_a.b").is_ok());
        for bad in ["a:b", "a b", "a{b}", "", "é"] {
            assert!(check_name("id", bad).is_err(), "{bad:?}");
        }
        assert!(check_name("id", &"a".repeat(MAX_ID_LEN + 1)).is_err());
    }

    #[test]
    fn entry_ids_hold_a_pool_and_a_request_id() {
        let longest = crate::kinds::answer::entry_id(
            "lottery",
            &"a".repeat(MAX_ID_LEN),
            &"r".repeat(MAX_ID_LEN),
            u64::MAX,
        );
        assert!(check_entry_id(&longest).is_ok(), "{}", longest.len());
        assert!(check_entry_id(&"e".repeat(MAX_ENTRY_ID_LEN + 1)).is_err());
        assert!(check_entry_id("a{b}").is_err());
        assert!(check_entry_id("").is_err());
    }
}
