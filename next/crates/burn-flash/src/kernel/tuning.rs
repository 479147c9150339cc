//! Environment overrides of the plans' choices, for tuning runs (`BURN_FLASH_*`). Each is read
//! once per process; an invalid value is ignored with a warning.

/// `0` (false) or `1` (true) from environment variable `name`, if set and valid.
pub fn flag_override(name: &str) -> Option<bool> {
    let text = std::env::var(name).ok()?;
    let flag = match text.trim() {
        "0" => Some(false),
        "1" => Some(true),
        _ => None,
    };
    if flag.is_none() {
        log::warn!("ignoring {name}={text:?}: expected 0 or 1");
    }
    flag
}

/// One of `allowed` from environment variable `name`, if set and valid.
pub fn choice_override(name: &str, allowed: &[usize]) -> Option<usize> {
    let text = std::env::var(name).ok()?;
    let choice = text.trim().parse().ok().filter(|v| allowed.contains(v));
    if choice.is_none() {
        log::warn!("ignoring {name}={text:?}: expected one of {allowed:?}");
    }
    choice
}

/// `planes,plane_rows,block_kv` from environment variable `name`, if set and valid.
pub fn shape_override(name: &str) -> Option<(usize, usize, usize)> {
    let text = std::env::var(name).ok()?;
    let parts: Vec<usize> = text
        .split(',')
        .filter_map(|p| p.trim().parse().ok())
        .collect();
    match parts[..] {
        [planes, rows, kv]
            if matches!(planes, 1 | 2 | 4 | 8)
                && matches!(rows, 16 | 32)
                && matches!(kv, 16 | 32 | 64 | 128) =>
        {
            Some((planes, rows, kv))
        }
        _ => {
            log::warn!("ignoring {name}={text:?}: expected planes,rows,kv");
            None
        }
    }
}
